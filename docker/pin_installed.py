"""Pin what an image already has installed, so that `pip install` can add packages but never change one.

    python3 pin_installed.py > pins.txt            # every installed distribution, as name==version
    python3 pin_installed.py torch > pins.txt      # only the named ones (an error if one is missing)
    python3 -m pip install -c pins.txt ".[plugin]"
    python3 pin_installed.py --check pins.txt      # exit 1 if any pinned distribution changed or vanished

server.Dockerfile pins everything the SGLang image ships (its torch, sglang and every library they
were built against stay as they are); trainer.Dockerfile pins the PyTorch image's torch. With the
pins as constraints pip either finds versions of the new packages that fit, or fails the build with
its resolver's message: it never silently swaps a CUDA build of torch for another.

Standard library only, plus the `packaging` that pip vendors. A distribution whose version is not
PEP 440 (some Debian-packaged modules) cannot be written as a constraint; it is named on stderr.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata

try:
    from packaging.version import InvalidVersion, Version
except ImportError:  # the image has no standalone `packaging`; pip always vendors one
    from pip._vendor.packaging.version import InvalidVersion, Version


def normalized(name: str) -> str:
    """PEP 503 name: `Torch_Audio` and `torch-audio` are the same distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    """{normalized name: version} of every distribution on sys.path; the first one found wins, as on import."""
    versions: dict[str, str] = {}
    for distribution in metadata.distributions():
        name = distribution.metadata["Name"]
        if name:
            versions.setdefault(normalized(name), distribution.version)
    return versions


def pins(names: list[str]) -> list[str]:
    versions = installed()
    wanted = [normalized(name) for name in names] or sorted(versions)
    missing = [name for name in wanted if name not in versions]
    if missing:
        raise SystemExit(f"pin_installed: not installed in this image: {', '.join(missing)}")
    lines = []
    for name in wanted:
        try:
            Version(versions[name])
        except InvalidVersion:
            print(f"pin_installed: {name} {versions[name]!r} is not a PEP 440 version; left unpinned", file=sys.stderr)
            continue
        lines.append(f"{name}=={versions[name]}")
    return lines


def check(pin_file: str) -> int:
    versions = installed()
    changed = []
    for line in open(pin_file, encoding="utf-8").read().split():
        name, _, version = line.partition("==")
        if versions.get(name) != version:
            changed.append(f"{name}: pinned {version}, now {versions.get(name, 'not installed')}")
    for change in changed:
        print(f"pin_installed: changed by the install: {change}", file=sys.stderr)
    return 1 if changed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="distributions to pin (default: all installed)")
    parser.add_argument("--check", metavar="PIN_FILE", help="verify that every pin still holds")
    args = parser.parse_args()
    if args.check:
        return check(args.check)
    print("\n".join(pins(args.names)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
