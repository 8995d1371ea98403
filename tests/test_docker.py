"""The docker/ deployment, checked without a docker engine: wiring, pins, sources, commands (tests/test_containers.py
builds and runs the images).

What must hold, and what each check reads it from:
- compose.yaml: the three services and their builds; one token variable shared by server, collector and
  client; the plugin's collector URL names the collector service and the port it listens on; the shard
  volume is written by the collector and mounted read-only by the trainer; every `${VAR}` has a default
  or is documented in docker/README.md; the environments load in the settings classes that read them.
- Dockerfiles (parsed here: line continuations, ARG substitution, exec forms): the server's base tag
  carries the Makefile's SGLang version, the trainer's the Makefile's torch; COPY sources exist and pass
  the Dockerfile's own ignore file; installs use the intended extras and keep the base image pinned.
- every `eagle-tap` command line (Dockerfiles, compose.yaml, README bash blocks) parses with the project's
  own argparse parser, and every `sglang.launch_server` flag is one the installed SGLang defines.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import os
import posixpath
import re
import shlex
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from capture_format.object_store import ENVIRONMENT_VARIABLES as OBJECT_STORE_VARIABLES
from eagle_tap.cli import build_parser

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCKER_DIR = REPO_ROOT / "docker"
COMPOSE_PATH = DOCKER_DIR / "compose.yaml"
README_PATH = DOCKER_DIR / "README.md"
IMAGES = ("server", "collector", "trainer")
EXTRAS = {"server": {"plugin"}, "collector": {"collector", "s3"}, "trainer": {"trainer", "client", "s3"}}
TEST_ENV = {"EAGLE_TAP_TOKEN": "test-token-0123456789", "MODEL_PATH": "/models/target"}
NEVER_SENT = (".venv/bin/python", "runs/r1/manifest.sqlite", ".git/HEAD", "eagle_tap/__pycache__/cli.cpython-311.pyc",
              "eagle_tap.egg-info/PKG-INFO", ".pytest_cache/v/cache/nodeids", "bench-out/x.json", "tests/conftest.py")


# --- Dockerfiles ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Instruction:
    keyword: str
    arguments: str
    line: int


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions with continuation lines joined; comments (also inside continuations) and blanks dropped."""
    instructions, pending, start = [], [], 0
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        start = start or number
        if stripped.endswith("\\"):
            pending.append(raw.rstrip()[:-1])
            continue
        keyword, _, arguments = "".join(pending + [raw]).strip().partition(" ")
        assert "<<" not in arguments, f"{path.name}:{start}: heredocs are not understood by this parser"
        instructions.append(Instruction(keyword.upper(), arguments.strip(), start))
        pending, start = [], 0
    assert not pending, f"{path.name} ends inside a line continuation"
    return instructions


def dockerfile(image: str) -> list[Instruction]:
    return parse_dockerfile(DOCKER_DIR / f"{image}.Dockerfile")


def base_image(image: str) -> str:
    """The FROM of the (single) stage, with the global ARG defaults substituted."""
    instructions = dockerfile(image)
    first_from = next(i for i, instruction in enumerate(instructions) if instruction.keyword == "FROM")
    defaults = dict(instruction.arguments.partition("=")[::2] for instruction in instructions[:first_from]
                    if instruction.keyword == "ARG")
    assert [instruction.keyword for instruction in instructions].count("FROM") == 1
    return interpolate(instructions[first_from].arguments.split()[0], defaults)


def exec_form(instruction: Instruction) -> list[str]:
    words = json.loads(instruction.arguments)
    assert isinstance(words, list), f"line {instruction.line}: use the exec (JSON) form"
    return words


def only(instructions: list[Instruction], keyword: str) -> Instruction:
    found = [instruction for instruction in instructions if instruction.keyword == keyword]
    assert len(found) == 1, f"expected one {keyword}, found {len(found)}"
    return found[0]


def shell_commands(text: str) -> list[list[str]]:
    """Simple commands of a shell line, split at && || ; | & with quotes respected; redirections dropped."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, words, tokens = [], [], list(lexer)
    index = 0
    while index < len(tokens):
        token = tokens[index]
        if token in ("&&", "||", ";", "|", "&"):
            commands.append(words)
            words = []
        elif token in (">", ">>", "<"):
            index += 1  # and its target
        else:
            words.append(token)
        index += 1
    commands.append(words)
    simple = []
    for words in commands:
        while words and re.match(r"[A-Za-z_]\w*=", words[0]):  # `NAME=value command ...` runs `command ...`
            words = words[1:]
        if words:
            simple.append(words)
    return simple


# --- compose ---------------------------------------------------------------------------------------

VARIABLE = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>\w+)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}|(?P<plain>\w+))")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's (and the Dockerfile's) `$VAR`, `${VAR}`, `${VAR:-default}`, `${VAR:?error}`, `${VAR:+alt}`, `$$`."""
    def replace(match: re.Match) -> str:
        if match["escaped"]:
            return "$"
        name, op, arg = match["braced"] or match["plain"], match["op"], match["arg"]
        value = env.get(name)
        unset = value is None or (value == "" and op is not None and op.startswith(":"))
        if op in (":-", "-"):
            return arg if unset else value
        if op in (":?", "?"):
            if unset:
                raise ValueError(f"required variable {name} is missing a value: {arg}")
            return value
        if op in (":+", "+"):
            return "" if unset else arg
        return value or ""

    return VARIABLE.sub(replace, text)


def interpolate_tree(node: object, env: dict[str, str]) -> object:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [interpolate_tree(item, env) for item in node]
    if isinstance(node, dict):
        return {key: interpolate_tree(value, env) for key, value in node.items()}
    return node


def variables(text: str) -> dict[str, str | None]:
    """{name: operator or None} of every variable referenced in text."""
    return {match["braced"] or match["plain"]: match["op"] for match in VARIABLE.finditer(text)
            if not match["escaped"]}


@functools.cache
def raw_compose() -> dict:
    return yaml.safe_load(COMPOSE_PATH.read_text(encoding="utf-8"))


def compose(env: dict[str, str] | None = None) -> dict:
    return interpolate_tree(raw_compose(), TEST_ENV if env is None else env)


def command_words(service: dict) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else list(command)


@dataclass(frozen=True, slots=True)
class Mount:
    source: str
    target: str
    read_only: bool


def mounts(service: dict) -> list[Mount]:
    found = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target, *mode = volume.split(":")
            found.append(Mount(source, target, "ro" in "".join(mode).split(",")))
        else:
            found.append(Mount(volume["source"], volume["target"], bool(volume.get("read_only", False))))
    return found


def image_of(service: dict) -> str:
    """Which of our Dockerfiles builds the service's image."""
    return Path(service["build"]["dockerfile"]).name.removesuffix(".Dockerfile")


# --- the project's parsers -----------------------------------------------------------------------

@functools.cache
def eagle_tap_parser():
    return build_parser()


def parse_eagle_tap(arguments: list[str], where: str) -> object | None:
    """The parsed namespace; None after --help. Fails the test with argparse's message otherwise."""
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            return eagle_tap_parser().parse_args(arguments)
    except SystemExit as exit_:
        assert exit_.code == 0, f"{where}: `eagle-tap {shlex.join(arguments)}` does not parse: {output.getvalue()}"
        return None


@functools.cache
def sglang_flags() -> frozenset[str]:
    """Option strings of the installed SGLang's launch_server, read from its source (importing it takes seconds)."""
    spec = importlib.util.find_spec("sglang")
    fields_dir = Path(spec.origin).parent / "srt" / "arg_groups" / "fields" if spec and spec.origin else None
    if fields_dir is None or not fields_dir.is_dir():
        pytest.skip("SGLang (with srt/arg_groups/fields) is not installed here")
    names = set()
    for path in [fields_dir.parent.parent / "server_args.py", *fields_dir.glob("*.py")]:
        text = path.read_text(encoding="utf-8")
        names |= {"--" + name.replace("_", "-") for name in re.findall(r"^    (\w+): *A\[", text, re.MULTILINE)}
        names |= set(re.findall(r"[\"'](--[a-z0-9][a-z0-9-]*)[\"']", text))
    return frozenset(names)


def check_sglang_flags(words: list[str], where: str) -> None:
    """Every --flag is an SGLang option or, as argparse allows, an unambiguous prefix of exactly one."""
    for word in words:
        if word.startswith("--"):
            flag = word.partition("=")[0]
            matches = [name for name in sglang_flags() if name.startswith(flag)]
            assert flag in sglang_flags() or len(matches) == 1, f"{where}: {flag} is not a flag of SGLang ({matches})"


def makefile_pin(variable: str) -> str:
    """The version of a `NAME ?= package==version` line of the Makefile."""
    match = re.search(rf"^{variable}\s*\?=\s*\S+==(\S+)$", (REPO_ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, f"no {variable} pin in the Makefile"
    return match[1]


@functools.cache
def pyproject() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))


# --- .dockerignore ---------------------------------------------------------------------------------

def glob_regex(pattern: str) -> re.Pattern:
    regex, index = "", 0
    while index < len(pattern):
        if pattern.startswith("**/", index):
            regex, index = regex + "(?:.*/)?", index + 3
        elif pattern.startswith("**", index):
            regex, index = regex + ".*", index + 2
        else:
            regex += {"*": "[^/]*", "?": "[^/]"}.get(pattern[index], re.escape(pattern[index]))
            index += 1
    return re.compile(f"^{regex}$")


def ignore_rules(image: str) -> list[tuple[bool, re.Pattern]]:
    """(is an exception, pattern) of the Dockerfile-specific ignore file, in order."""
    rules = []
    for line in (DOCKER_DIR / f"{image}.Dockerfile.dockerignore").read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            exception = line.startswith("!")
            pattern = posixpath.normpath(line.removeprefix("!").strip()).lstrip("/")
            rules.append((exception, glob_regex(pattern)))
    return rules


def is_sent(relative_path: str, rules: list[tuple[bool, re.Pattern]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent directories decides."""
    parts = relative_path.split("/")
    paths = ["/".join(parts[:count]) for count in range(1, len(parts) + 1)]
    sent = True
    for exception, regex in rules:
        if any(regex.match(path) for path in paths):
            sent = exception
    return sent


def copy_sources(image: str) -> list[str]:
    sources = []
    for instruction in dockerfile(image):
        assert instruction.keyword != "ADD", f"{image}.Dockerfile:{instruction.line}: use COPY"
        if instruction.keyword == "COPY":
            words = shlex.split(instruction.arguments)
            assert not any(word.startswith("--from") for word in words), "single-stage images only"
            sources += [word for word in words[:-1] if not word.startswith("--")]
    return sources


# === compose.yaml ==================================================================================

def test_compose_services_build_from_the_repository_with_existing_dockerfiles() -> None:
    services = raw_compose()["services"]
    assert set(services) == {"collector", "server", "trainer"}
    for name, service in services.items():
        build = service["build"]
        assert build["context"] == "..", f"{name}: the build context must be the repository root"
        path = (COMPOSE_PATH.parent / build["context"] / build["dockerfile"]).resolve()
        assert path.is_file() and path.parent == DOCKER_DIR, f"{name}: no Dockerfile at {path}"
        assert image_of(service) == name
        assert path.with_name(path.name + ".dockerignore").is_file(), f"{name}: no ignore file next to {path.name}"


def test_every_variable_has_a_default_or_is_documented() -> None:
    readme = README_PATH.read_text(encoding="utf-8")
    found = variables(COMPOSE_PATH.read_text(encoding="utf-8"))
    assert {"EAGLE_TAP_TOKEN", "MODEL_PATH", "TP"} <= set(found)
    undocumented = [name for name, op in found.items() if op not in (":-", "-") and f"`{name}`" not in readme]
    assert not undocumented, f"variables without a default, missing from docker/README.md: {undocumented}"
    for name in ("EAGLE_TAP_TOKEN", "MODEL_PATH"):
        with pytest.raises(ValueError, match=name):
            compose({key: value for key, value in TEST_ENV.items() if key != name})


def test_server_collector_and_client_share_one_token_variable() -> None:
    services = raw_compose()["services"]
    token_values = {"collector": services["collector"]["environment"]["EAGLE_TAP_COLLECTOR_TOKEN"],
                    "server": services["server"]["environment"]["EAGLE_TAP_TOKEN"],
                    "trainer": services["trainer"]["environment"]["EAGLE_TAP_TOKEN"]}
    for name, value in token_values.items():
        assert set(variables(value)) == {"EAGLE_TAP_TOKEN"}, f"{name}: the token must come from $EAGLE_TAP_TOKEN"
    interpolated = compose()["services"]
    assert interpolated["collector"]["environment"]["EAGLE_TAP_COLLECTOR_TOKEN"] == TEST_ENV["EAGLE_TAP_TOKEN"]
    assert interpolated["server"]["environment"]["EAGLE_TAP_TOKEN"] == TEST_ENV["EAGLE_TAP_TOKEN"]


COLLECTOR_ENTRYPOINT = ["python", "-m", "collector_service"]


def test_the_collector_image_holds_only_the_format_and_the_collector() -> None:
    """It runs no code of the other parts, so it copies none (the house's floors: tests/test_architecture.py)."""
    copied = {Path(instruction.arguments.split()[0]).parts[0]
              for instruction in dockerfile("collector") if instruction.keyword == "COPY"}
    assert copied == {"pyproject.toml", "capture_format", "collector_service"}


def collector_arguments(env: dict[str, str] | None = None) -> list[str]:
    """The collector container's command: compose's `command`, else the image's CMD, after its ENTRYPOINT (the
    collector's own command line, whose subcommands are eagle-tap's `collect` and `shards`)."""
    assert exec_form(only(dockerfile("collector"), "ENTRYPOINT")) == COLLECTOR_ENTRYPOINT
    service = compose(env)["services"]["collector"]
    return command_words(service) if "command" in service else exec_form(only(dockerfile("collector"), "CMD"))


def test_the_plugin_reaches_the_collector_service_on_its_port() -> None:
    services = compose()["services"]
    arguments = parse_eagle_tap(collector_arguments(), "compose collector")
    url = urlparse(services["server"]["environment"]["EAGLE_TAP_COLLECTOR_URL"])
    assert (url.scheme, url.hostname, url.port) == ("http", "collector", arguments.port)
    assert arguments.host == "0.0.0.0"
    assert services["server"]["depends_on"]["collector"]["condition"] == "service_healthy"
    healthcheck = only(dockerfile("collector"), "HEALTHCHECK").arguments
    assert "healthcheck" in services["collector"] or f"127.0.0.1:{arguments.port}/healthz" in healthcheck
    assert only(dockerfile("collector"), "EXPOSE").arguments == str(arguments.port)
    for published in services["collector"].get("ports", []):
        assert published.endswith(f":{arguments.port}") and published.startswith("127.0.0.1:")


def test_captures_volume_is_written_by_the_collector_and_read_only_for_the_trainer() -> None:
    config = compose()
    assert "captures" in config["volumes"]
    services = config["services"]
    [collector_mount] = [mount for mount in mounts(services["collector"]) if mount.source == "captures"]
    [trainer_mount] = [mount for mount in mounts(services["trainer"]) if mount.source == "captures"]
    assert not collector_mount.read_only and trainer_mount.read_only
    for capture_set in ("captures", "heldout"):
        data_dir = parse_eagle_tap(collector_arguments({**TEST_ENV, "CAPTURE_SET": capture_set}), "collector").data_dir
        assert posixpath.dirname(data_dir) == collector_mount.target, "shards must land on the captures volume"
    assert "captures" not in [mount.source for mount in mounts(services["server"])]
    spool_dir = services["server"]["environment"]["EAGLE_TAP_SPOOL_DIR"]
    assert any(mount.target == spool_dir and mount.source in config["volumes"] for mount in mounts(services["server"]))


def test_the_server_image_makes_the_spool_directory_private() -> None:
    spool_dir = compose()["services"]["server"]["environment"]["EAGLE_TAP_SPOOL_DIR"]
    runs = " ".join(instruction.arguments for instruction in dockerfile("server") if instruction.keyword == "RUN")
    assert f"install -d -m 0700 {spool_dir}" in runs, "a volume there starts 0755 and the plugin would refuse it"


def test_server_environment_loads_in_the_plugin_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_patch.settings import CaptureSettings

    environment = compose()["services"]["server"]["environment"]
    plugin_names = {name for name in environment if name.startswith("EAGLE_TAP_")}
    defined = {f"EAGLE_TAP_{field.upper()}" for field in CaptureSettings.model_fields}
    assert plugin_names <= defined, f"the plugin has no settings {sorted(plugin_names - defined)}"
    for name in [name for name in os.environ if name.startswith("EAGLE_TAP_")]:
        monkeypatch.delenv(name)
    for layers, expected in (("", None), ("3,31,59", [3, 31, 59])):
        values = compose({**TEST_ENV, "EAGLE_TAP_CAPTURE_LAYERS": layers})["services"]["server"]["environment"]
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))
        settings = CaptureSettings()
        assert settings.enabled and settings.collector_url == "http://collector:8470"
        assert settings.token.get_secret_value() == TEST_ENV["EAGLE_TAP_TOKEN"]
        assert settings.capture_layers == expected and str(settings.spool_dir) == values["EAGLE_TAP_SPOOL_DIR"]
        assert settings.inflight_max_bytes >= 4 << 30, "a 7168-wide record of 9,400 tokens is over 512 MiB raw"


def test_collector_command_and_environment_load_in_its_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from collector_service.cli import _settings_overrides
    from collector_service.settings import CollectorSettings

    environment = compose()["services"]["collector"]["environment"]
    defined = {f"EAGLE_TAP_COLLECTOR_{field.upper()}" for field in CollectorSettings.model_fields}
    defined |= set(OBJECT_STORE_VARIABLES)  # read by the uploads' S3 client, not by CollectorSettings
    assert set(environment) <= defined, f"the collector has no settings {sorted(set(environment) - defined)}"
    overrides = _settings_overrides(parse_eagle_tap(collector_arguments(), "compose collector"))
    with pytest.raises(ValueError, match="not loopback and no token"):
        CollectorSettings(**overrides)  # the image refuses to listen on 0.0.0.0 without a token
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    settings = CollectorSettings(**overrides)
    assert settings.token.get_secret_value() == TEST_ENV["EAGLE_TAP_TOKEN"] and settings.host == "0.0.0.0"
    assert settings.upload_to is None and settings.keep_local is False  # shards stay on the volume by default


def test_collector_and_trainer_point_at_a_bucket_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from collector_service.cli import _settings_overrides
    from collector_service.settings import CollectorSettings

    bucket = {"EAGLE_TAP_UPLOAD_TO": "s3://captures-bucket/dsv3", "EAGLE_TAP_S3_ENDPOINT_URL": "http://minio:9000",
              "AWS_ACCESS_KEY_ID": "key", "AWS_SECRET_ACCESS_KEY": "secret", "EAGLE_TAP_KEEP_LOCAL": "true"}
    services = compose({**TEST_ENV, **bucket})["services"]
    for name, value in services["collector"]["environment"].items():
        monkeypatch.setenv(name, value)
    settings = CollectorSettings(**_settings_overrides(parse_eagle_tap(collector_arguments(), "compose collector")))
    assert settings.upload_to == "s3://captures-bucket/dsv3" and settings.keep_local is True
    for service in ("collector", "trainer"):
        environment = services[service]["environment"]
        assert {name: environment[name] for name in bucket if name.startswith(("AWS_", "EAGLE_TAP_S3"))} == {
            name: value for name, value in bucket.items() if name.startswith(("AWS_", "EAGLE_TAP_S3"))}
        defined = {f"EAGLE_TAP_COLLECTOR_{field.upper()}" for field in CollectorSettings.model_fields}
        assert set(environment) - {"EAGLE_TAP_TOKEN"} <= defined | set(OBJECT_STORE_VARIABLES)


def test_gpu_server_command_is_valid_sglang_and_serves_no_draft() -> None:
    server = compose()["services"]["server"]
    assert exec_form(only(dockerfile("server"), "ENTRYPOINT")) == ["python3", "-m", "sglang.launch_server"]
    words = command_words(server)
    check_sglang_flags(words, "compose server command")
    assert words[words.index("--model-path") + 1] == TEST_ENV["MODEL_PATH"]
    assert words[words.index("--tp") + 1] == "1" and words[words.index("--host") + 1] == "0.0.0.0"
    assert not any(word.startswith("--speculative-draft") for word in words), "a capture replica serves no draft"
    [device] = server["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert server["ipc"] == "host" and server["shm_size"]
    port = words[words.index("--port") + 1]
    assert f"127.0.0.1:{port}/health" in " ".join(server["healthcheck"]["test"])


def test_trainer_starts_only_when_asked_and_depends_on_nothing() -> None:
    trainer = raw_compose()["services"]["trainer"]
    assert trainer["profiles"] == ["train"]
    assert "depends_on" not in trainer, "`docker compose run trainer` must not start the GPU server"
    assert exec_form(only(dockerfile("trainer"), "ENTRYPOINT")) == ["eagle-tap"]


# === Dockerfiles ===================================================================================

def test_server_base_image_is_the_pinned_sglang_the_plugin_supports() -> None:
    from sglang_patch import SUPPORTED_SGLANG_VERSIONS

    version = makefile_pin("SGLANG_SPEC")
    assert base_image("server") == f"lmsysorg/sglang:v{version}"
    assert version in SUPPORTED_SGLANG_VERSIONS
    for text in (README_PATH.read_text(encoding="utf-8"), COMPOSE_PATH.read_text(encoding="utf-8")):
        for tag in re.findall(r"lmsysorg/sglang:(v[\w.-]+)", text):
            # v0.5.19-cu129 is only named, as the last CUDA 12 image; every tag used must be the pinned version.
            assert tag.startswith(f"v{version}") or tag == "v0.5.19-cu129", f"SGLang tag {tag} is not v{version}"


def test_trainer_base_image_carries_the_tested_torch() -> None:
    tag_pattern = r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-(?:runtime|devel)"
    match = re.fullmatch(tag_pattern, base_image("trainer"))
    assert match and match[1] == makefile_pin("TORCH_SPEC"), base_image("trainer")


def test_collector_base_image_meets_requires_python() -> None:
    assert base_image("collector") == "python:3.11-slim"
    required = pyproject()["project"]["requires-python"]
    assert required.startswith(">=") and (3, 11) >= tuple(int(part) for part in required[2:].split("."))


@pytest.mark.parametrize("image", IMAGES)
def test_copy_sources_exist_pass_the_ignore_file_and_cover_the_package(image: str) -> None:
    rules = ignore_rules(image)
    sources = copy_sources(image)
    for source in sources:
        assert (REPO_ROOT / source).exists(), f"{image}.Dockerfile copies {source}, which does not exist"
        tracked = subprocess.run(["git", "ls-files", "--", source], cwd=REPO_ROOT, capture_output=True, text=True,
                                 check=True).stdout.split() or [source]
        blocked = [path for path in tracked if not is_sent(path, rules)]
        assert not blocked, f"{image}.Dockerfile.dockerignore keeps out what the image copies: {blocked[:5]}"
    leaked = [path for path in NEVER_SENT if is_sent(path, rules)]
    assert not leaked, f"{image}.Dockerfile.dockerignore sends {leaked}"
    patterns = pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {name for name in (pattern.rstrip("*") for pattern in patterns) if (REPO_ROOT / name).is_dir()}
    if image == "collector":  # it runs only the collector, which imports only the format (test_architecture.py)
        packages = {"capture_format", "collector_service"}
    needed = {"pyproject.toml", pyproject()["project"]["readme"]} | packages
    assert needed <= set(sources), f"{image}.Dockerfile does not copy {sorted(needed - set(sources))}"


@pytest.mark.parametrize("image", IMAGES)
def test_installs_use_the_intended_extras_and_keep_the_base_pinned(image: str) -> None:
    runs = [instruction.arguments for instruction in dockerfile(image) if instruction.keyword == "RUN"]
    commands = [words for run in runs for words in shell_commands(run)]
    [install] = [words for words in commands
                 if (words[0] == "pip" or words[1:3] == ["-m", "pip"]) and "install" in words]
    [extras] = [set(match[1].split(",")) for word in install if (match := re.search(r"\[([\w,-]+)\]$", word))]
    assert extras == EXTRAS[image] and extras <= set(pyproject()["project"]["optional-dependencies"])
    if image == "collector":
        return
    position = commands.index(install)
    [(pinned, pin_file)] = re.findall(r"pin_installed\.py([\w ]*)> *(\S+)", " ".join(runs))
    assert install[install.index("-c") + 1] == pin_file, "install with the image's pins as constraints"
    expected_pins = ["torch"] if image == "trainer" else []  # all of the SGLang image; torch of PyTorch's
    assert pinned.split() == expected_pins
    assert any("--check" in words and "pin_installed.py" in words for words in commands[position + 1:])


def test_collector_image_runs_unprivileged_on_the_data_volume() -> None:
    instructions = dockerfile("collector")
    assert only(instructions, "USER").arguments not in ("root", "0")
    assert "/data" in only(instructions, "VOLUME").arguments.split()
    arguments = parse_eagle_tap(exec_form(only(instructions, "CMD")), "collector.Dockerfile CMD")
    assert arguments.data_dir.startswith("/data/") and arguments.port == 8470 and arguments.token is None
    healthcheck = only(instructions, "HEALTHCHECK").arguments
    assert f"http://127.0.0.1:{arguments.port}/healthz" in healthcheck


@pytest.mark.parametrize("image", IMAGES)
def test_eagle_tap_commands_in_dockerfiles_parse(image: str) -> None:
    instructions = dockerfile(image)
    entrypoint = exec_form(only(instructions, "ENTRYPOINT"))
    if entrypoint in (["eagle-tap"], COLLECTOR_ENTRYPOINT):
        parse_eagle_tap(exec_form(only(instructions, "CMD")), f"{image}.Dockerfile CMD")
    for instruction in instructions:
        if instruction.keyword == "RUN":
            for words in shell_commands(instruction.arguments):
                if words[0] == "eagle-tap":
                    parse_eagle_tap(words[1:], f"{image}.Dockerfile:{instruction.line}")


# === docker/README.md ==============================================================================

RUN_OPTIONS_WITH_VALUE = {"-e", "--env", "--entrypoint", "-v", "--volume", "-w", "--workdir", "-u", "--user",
                          "--name", "-p", "--publish", "-l", "--label"}


def readme_commands() -> list[list[str]]:
    """Simple commands of the README's bash blocks, continuation lines joined, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", README_PATH.read_text(encoding="utf-8"), re.DOTALL)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0] if not line.lstrip().startswith("#") else ""
            commands += shell_commands(line)
    return commands


def eagle_tap_arguments(words: list[str]) -> list[str] | None:
    """The eagle-tap argv of a README command: `eagle-tap ...`, `-m eagle_tap.cli ...` or `compose run trainer ...`."""
    if words[0] == "eagle-tap":
        return words[1:]
    for index in range(len(words) - 1):
        if words[index:index + 2] == ["-m", "eagle_tap.cli"]:
            return words[index + 2:]
    if words[:2] == ["docker", "compose"] and "run" in words:
        index, entrypoint = words.index("run") + 1, None
        while words[index].startswith("-"):
            if words[index] == "--entrypoint":
                entrypoint = words[index + 1]
            index += 2 if words[index] in RUN_OPTIONS_WITH_VALUE else 1
        service = raw_compose()["services"][words[index]]
        if entrypoint is None and image_of(service) in ("trainer", "collector"):
            return words[index + 1:]
    return None


def test_readme_commands_parse_with_the_project_and_sglang_parsers() -> None:
    subcommands, sglang_commands = set(), []
    for words in readme_commands():
        if "sglang.launch_server" in words:
            tail = words[words.index("sglang.launch_server") + 1:]
            check_sglang_flags(tail, f"README: {shlex.join(words)}")
            sglang_commands.append(tail)
        arguments = eagle_tap_arguments(words)
        if arguments is not None:
            namespace = parse_eagle_tap(arguments, "docker/README.md")
            subcommands.add(namespace.command)
            if namespace.command == "fire":
                assert namespace.regenerate and namespace.server == "http://server:30000"
    assert {"fire", "draft-config", "vocab", "train", "eval", "export", "shards"} <= subcommands
    assert any({"--speculative-algorithm", "--speculative-draft-model-path"} <= set(tail) for tail in sglang_commands)
    readme = README_PATH.read_text(encoding="utf-8")
    assert "EAGLE_TAP_CAPTURE_LAYERS=3,31,59" in readme and "--nproc-per-node 8" in readme
    assert "57,344" in readme and "the gpu images are not built here" in readme.lower()
