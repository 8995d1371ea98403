"""`python -m collector_service collect --shards D ...`: the collector's subcommands without the eagle-tap CLI."""

import sys

from collector_service.cli import main

sys.exit(main())
