"""Build eagle-tap's three images on a machine that reaches no image registry and has no GPU.

    python3 docker/build_local.py              # as root: the local bases, then collector, server, trainer
    python3 docker/build_local.py --rebuild    # build every image again, the Debian base included

The GPU bases (`pytorch/pytorch`, `lmsysorg/sglang`) and `python:3.11-slim` cannot be pulled here, so this
builds stand-ins for them first, from packages only:

    eagle-tap/debian-python:bookworm   debootstrap of Debian bookworm with its python3 (3.11) and pip, imported
    eagle-tap/torch-cpu:<torch>-cpu    + the CPU wheel of the Makefile's TORCH_SPEC (`pip download` finds it the
                                         way `make install` does), docker/cpu-bases.Dockerfile
    eagle-tap/sglang-cpu:v<sglang>     + SGLang the Makefile's way (--no-deps, requirements/sglang-cpu.txt)

and then builds docker/{collector,server,trainer}.Dockerfile unchanged, with only their base image arguments
pointed at those (eagle-tap-{collector,server,trainer}:local). An image that exists is kept unless --rebuild.

Each build context is a tar stream this script writes (the git-tracked and untracked-but-not-ignored files
of the repository; the wheel and two files for the bases), so the classic builder works as well as
BuildKit, and nothing ignored (.venv, runs, caches) is ever sent. Builds use the host's network
(`--network host`): pip inside reaches the same package index as the host, and no bridge is needed.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEBIAN_IMAGE = "eagle-tap/debian-python:bookworm"
DEBIAN_PACKAGES = ("python3", "python3-pip", "python3-venv", "python-is-python3", "ca-certificates")
IMAGES = ("collector", "server", "trainer")


def makefile_pin(variable: str) -> str:
    """The version in the Makefile's `VARIABLE ?= name==version`."""
    text = (REPO_ROOT / "Makefile").read_text(encoding="utf-8")
    match = re.search(rf"^{variable} \?= [\w-]+==([\w.]+)$", text, re.MULTILINE)
    if match is None:
        raise SystemExit(f"build_local: no `{variable} ?= name==version` line in the Makefile")
    return match[1]


def local_tags() -> dict[str, str]:
    torch, sglang = makefile_pin("TORCH_SPEC"), makefile_pin("SGLANG_SPEC")
    return {"torch-cpu": f"eagle-tap/torch-cpu:{torch}-cpu", "sglang-cpu": f"eagle-tap/sglang-cpu:v{sglang}",
            **{image: f"eagle-tap-{image}:local" for image in IMAGES}}


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(command), flush=True)
    return subprocess.run(command, check=True, **kwargs)


def image_exists(docker: str, tag: str) -> bool:
    return subprocess.run([docker, "image", "inspect", tag], capture_output=True).returncode == 0


def build_debian_base(docker: str, mirror: str, ca_bundle: Path | None) -> None:
    """debootstrap, then `docker import` with the environment pip needs to install into Debian's Python.

    `ca_bundle` replaces the image's certificate bundle: the host's, so that pip inside the builds trusts
    whatever the host trusts on its way to the package index (a TLS-inspecting proxy's own authority)."""
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None or os.geteuid() != 0:
        raise SystemExit("build_local: the Debian base needs root and debootstrap (apt-get install debootstrap)")
    with tempfile.TemporaryDirectory(prefix="eagle-tap-rootfs-") as scratch:
        rootfs = Path(scratch) / "rootfs"
        run([debootstrap, "--variant=minbase", f"--include={','.join(DEBIAN_PACKAGES)}", "bookworm", str(rootfs),
             mirror], stdout=subprocess.DEVNULL)
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (rootfs / leftover).glob("*"):
                if path.is_file():
                    path.unlink()
        if ca_bundle is not None:
            shutil.copyfile(ca_bundle, rootfs / "etc/ssl/certs/ca-certificates.crt")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        # Debian marks its Python externally managed; images install into it as the official ones do.
        run([docker, "import", "--change", "ENV PIP_BREAK_SYSTEM_PACKAGES=1", "--change", "ENV LANG=C.UTF-8",
             "--change", 'CMD ["python3"]', "-", DEBIAN_IMAGE], stdin=tar.stdout, stdout=subprocess.DEVNULL)
        if tar.wait() != 0:
            raise SystemExit("build_local: tar of the Debian root failed")


def repository_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    return sorted(path for path in listed if path and (REPO_ROOT / path).is_file())


def write_context(files: dict[str, Path], destination: Path) -> None:
    """A build context holding exactly `files` ({path in the context: file here})."""
    # GNU, not PAX (tarfile's default): the docker client tells a context tar from a Dockerfile on stdin by a
    # header check that a leading PAX header fails.
    with tarfile.open(destination, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, path in sorted(files.items()):
            tar.add(path, arcname=name, recursive=False)


def docker_build(docker: str, context: Path, dockerfile: str, tag: str, build_args: dict[str, str],
                 target: str | None = None) -> None:
    command = [docker, "build", "--network", "host", "-f", dockerfile, "-t", tag]
    command += [f"--build-arg={key}={value}" for key, value in build_args.items()]
    command += ["--target", target] if target else []
    started = time.monotonic()
    with context.open("rb") as stream:
        run(command + ["-"], stdin=stream)
    print(f"built {tag} in {time.monotonic() - started:.0f} s", flush=True)


def torch_wheel(directory: Path) -> Path:
    """The wheel `make install` would install, fetched the same way (pip's own configuration picks it)."""
    spec = f"torch=={makefile_pin('TORCH_SPEC')}"
    run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", str(directory), spec])
    [wheel] = directory.glob("torch-*.whl")
    if "+cpu" not in wheel.name:
        raise SystemExit(f"build_local: pip found {wheel.name} for {spec}, not a CPU wheel (+cpu); "
                         "point pip at one (PIP_FIND_LINKS) so the images do not carry a CUDA torch")
    return wheel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rebuild", action="store_true", help="build every image again")
    parser.add_argument("--only", choices=("bases",) + IMAGES, action="append",
                        help="build only these (and the bases they need); repeatable")
    parser.add_argument("--mirror", default="http://deb.debian.org/debian", help="Debian mirror for debootstrap")
    host_bundle = os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt"
    parser.add_argument("--ca-bundle", type=Path, default=Path(host_bundle) if Path(host_bundle).is_file() else None,
                        help="certificate bundle the Debian base trusts (default: $PIP_CERT, else the host's "
                             "/etc/ssl/certs/ca-certificates.crt)")
    args = parser.parse_args(argv)
    docker = shutil.which("docker") or sys.exit("build_local: no docker client on PATH")
    if subprocess.run([docker, "version", "--format", "{{.Server.Version}}"], capture_output=True).returncode:
        raise SystemExit("build_local: no docker engine answers (DOCKER_HOST?)")
    tags = local_tags()
    wanted = set(args.only or ("bases",) + IMAGES)

    def needed(tag: str) -> bool:
        return args.rebuild or not image_exists(docker, tag)

    if needed(DEBIAN_IMAGE):
        build_debian_base(docker, args.mirror, args.ca_bundle)
    with tempfile.TemporaryDirectory(prefix="eagle-tap-context-") as scratch:
        scratch = Path(scratch)
        if wanted & {"bases", "server", "trainer"} and (needed(tags["torch-cpu"]) or needed(tags["sglang-cpu"])):
            wheel = torch_wheel(scratch / "wheels")
            context = scratch / "bases.tar"
            write_context({"docker/cpu-bases.Dockerfile": REPO_ROOT / "docker/cpu-bases.Dockerfile",
                           "docker/pin_installed.py": REPO_ROOT / "docker/pin_installed.py",
                           "requirements/sglang-cpu.txt": REPO_ROOT / "requirements/sglang-cpu.txt",
                           f"wheels/{wheel.name}": wheel}, context)
            base_args = {"PYTHON_IMAGE": DEBIAN_IMAGE, "SGLANG_SPEC": f"sglang=={makefile_pin('SGLANG_SPEC')}"}
            for stage in ("torch-cpu", "sglang-cpu"):
                if needed(tags[stage]):
                    docker_build(docker, context, "docker/cpu-bases.Dockerfile", tags[stage], base_args, stage)
        images = [image for image in IMAGES if image in wanted and needed(tags[image])]
        if images:
            context = scratch / "repository.tar"
            write_context({path: REPO_ROOT / path for path in repository_files()}, context)
        image_args = {
            "collector": {"PYTHON_IMAGE": DEBIAN_IMAGE},
            "server": dict(zip(("SGLANG_IMAGE", "SGLANG_TAG"), tags["sglang-cpu"].split(":"))),
            "trainer": dict(zip(("PYTORCH_IMAGE", "PYTORCH_TAG"), tags["torch-cpu"].split(":"))),
        }
        for image in images:
            docker_build(docker, context, f"docker/{image}.Dockerfile", tags[image], image_args[image])
    return 0


if __name__ == "__main__":
    sys.exit(main())
