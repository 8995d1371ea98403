"""eagle-tap's SGLang plugin: captures the hidden states of tagged requests inside a running server.

Loaded by SGLang through the `sglang.srt.plugins` entry point (`sglang_patch.plugin:register`) in
every SGLang process; dormant unless `EAGLE_TAP_COLLECTOR_URL` is set. See `plugin.py` for what it
hooks and the server flags it turns on, `capture.py` for how rows map to requests, and `sender.py`
for how records leave the process without ever blocking serving.
"""

# The SGLang versions this plugin was tested with; on any other it logs why and stays dormant.
SUPPORTED_SGLANG_VERSIONS: tuple[str, ...] = ("0.5.23",)
