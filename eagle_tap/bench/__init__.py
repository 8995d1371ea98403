"""`eagle-tap bench`: the project's benchmarks, run side by side in one process and reported together.

Each benchmark module (`codecs`, `collector`, `capture`, `trainer_pipeline`, `swap`, ...) has a typed `Config`
(its defaults are the full run, `Config.quick()` a shorter one) and `run(config) -> dict`, which
measures and returns plain data that `json.dumps` takes as is:

    {"title": str, "parameters": {...}, "columns": [[key, header, format], ...],
     "rows": [{key: value, ...}, ...], "summary": {...}, "notes": [str, ...]}

`rows` holds one entry per measured item, `columns` says how `report.py` renders them as a Markdown
table, `summary` holds the headline numbers (ratios) and `notes` the lines printed under the table.
Ratios compare numbers measured in the same run, so machine drift hits both sides. None of this is
a timed test: tests only check that results are well-formed.
"""
