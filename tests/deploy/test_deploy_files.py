"""The Dockerfile, deploy/kubernetes(-shared) and deploy/compose, checked without an engine.

- Dockerfile: hadolint, its shape, and its own install commands: the `RUN` lines marked
  `# test: build` and `# test: install` are read from the Dockerfile and run here as they
  are, on a copy of what the build stage `COPY`s, into a fresh virtual environment, whose
  `sfq-proxy serve` must answer /healthz and exit 0 on SIGTERM. Reading the commands from
  the Dockerfile (rather than repeating them) means they cannot drift apart; only the paths,
  which the commands take from the variables VIRTUAL_ENV and WHEELS, point into tmp_path.
- Kubernetes: every manifest but the ServiceMonitor (a CRD) against the API schemas of
  pinned Kubernetes versions (kubernetes-validate, strict), the ServiceMonitor by structure,
  and the cross-references: labels and selectors, ports, probes, volumes, Secret keys, the
  environment the ConfigMap's proxy config needs, which must itself be a valid config.
- deploy/kubernetes-shared, the kustomize overlay with the state in Redis: built here by a
  small kustomize of the few features it uses (and, where kubectl is installed, compared
  with `kubectl kustomize`), then checked like the base: schemas, replicas and rollout,
  the PodDisruptionBudget, the Redis it points at, and its config = the base's + state.
- Compose: `docker-compose config` (Debian's docker-compose, no engine needed), mounted host
  paths, service names the configs refer to, and the compose proxy config against the sims
  and the scenario the loadgen service replays; the shared profile's replicas and Redis.

hadolint and kubernetes-validate are development dependencies: a missing one fails its test
rather than skipping it. docker-compose is Debian's (`make tools`): without it its test
skips, and fails under CI.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from packaging.requirements import Requirement
from tools import need_tool

from sfq_proxy.config import Config, RedisState, parse_config
from sfq_proxy.runner.server import EXIT_WITHIN_S
from sfq_proxy.sim.settings import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
LOCK = ROOT / "requirements.lock"
KUBE = ROOT / "deploy" / "kubernetes"
SHARED = ROOT / "deploy" / "kubernetes-shared"
COMPOSE_DIR = ROOT / "deploy" / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]

ENTRYPOINT = ["sfq-proxy", "serve", "--config", "/etc/sfq-proxy/config.yaml"]
CONFIG_PATH = Path(ENTRYPOINT[-1])
IMAGE_UID = 10001
# the oldest Kubernetes release the manifests target, and a recent one
KUBERNETES_VERSIONS = ["1.29.0", "1.33.0"]


def venv_tool(name: str) -> str:
    """A development tool: beside this interpreter (the project's venv), else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found, f"{name} is not installed: it is a development dependency (pip install -e .[dev])"
    return found


# -- the Dockerfile -------------------------------------------------------------------------


@dataclass
class Instruction:
    keyword: str  # upper case: RUN, COPY, ...
    args: str  # continuation lines joined
    marker: str | None  # `x` of a `# test: x` comment right above it


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def env(self) -> dict[str, str]:
        """The stage's ENV values, `${X}` references expanded from the earlier ones."""
        env: dict[str, str] = {}
        for instruction in self.all("ENV"):
            for pair in shlex.split(instruction.args):
                name, _, value = pair.partition("=")
                env[name] = re.sub(r"\$\{(\w+)\}", lambda m: env.get(m[1], ""), value)
        return env

    def marked(self, marker: str) -> Instruction:
        [instruction] = [i for i in self.instructions if i.marker == marker]
        assert instruction.keyword == "RUN", instruction
        return instruction


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """The global ARGs and the stages, `${ARG}` substituted in FROM."""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    marker: str | None = None
    lines = iter(text.splitlines())
    for line in lines:
        stripped = line.strip()
        if not stripped:
            marker = None
            continue
        if stripped.startswith("#"):
            found = re.fullmatch(r"#\s*test:\s*(\w+)", stripped)
            marker = found[1] if found else marker
            continue
        while stripped.endswith("\\"):
            stripped = stripped[:-1].rstrip()
            following = next(lines).strip()
            if not following.startswith("#"):  # Docker drops comments inside continuations
                stripped += " " + following
        keyword, _, rest = stripped.partition(" ")
        instruction = Instruction(keyword.upper(), rest.strip(), marker)
        marker = None
        if instruction.keyword == "FROM":
            image, *alias = instruction.args.split()
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], image)
            stages.append(Stage(image, alias[1] if alias else None))
        elif not stages and instruction.keyword == "ARG":
            name, _, value = instruction.args.partition("=")
            args[name] = value
        else:
            stages[-1].instructions.append(instruction)
    return args, stages


def stages() -> list[Stage]:
    return parse_dockerfile(DOCKERFILE.read_text())[1]


def copy_args(instruction: Instruction) -> tuple[dict[str, str], list[str], str]:
    """A COPY's --flags, sources and destination."""
    words = instruction.args.split()
    flags = dict(w[2:].partition("=")[::2] for w in words if w.startswith("--"))
    *sources, dest = [w for w in words if not w.startswith("--")]
    return flags, sources, dest


def test_hadolint_is_clean() -> None:
    labels = ["title:text", "description:text", "version:semver", "licenses:spdx", "base.name:text"]
    command = [venv_tool("hadolint"), "--no-color", "--failure-threshold", "style"]
    command += ["--disable-ignore-pragma", "--strict-labels"]
    for label in labels:
        command += ["--require-label", f"org.opencontainers.image.{label}"]
    result = subprocess.run(
        [*command, str(DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_shape() -> None:
    build, final = stages()
    assert build.base == final.base
    assert re.fullmatch(r"python:3\.12-slim(@sha256:[0-9a-f]{64})?", final.base), final.base
    assert build.name == "build"
    assert "pip wheel --no-cache-dir --no-deps" in build.marked("build").args
    assert [i.keyword for i in final.instructions].count("USER") == 1
    assert final.all("USER")[0].args == f"{IMAGE_UID}:{IMAGE_UID}"  # numeric: runAsNonRoot
    assert final.all("EXPOSE")[0].args == "8080"
    assert final.all("STOPSIGNAL")[0].args == "SIGTERM"
    assert json.loads(final.all("ENTRYPOINT")[0].args) == ENTRYPOINT
    assert not final.all("CMD")
    [healthcheck] = final.all("HEALTHCHECK")
    exec_form = json.loads(healthcheck.args[healthcheck.args.index("CMD") + 3 :].strip())
    assert exec_form[:2] == ["python", "-c"]
    assert "urllib.request.urlopen('http://127.0.0.1:8080/healthz'" in exec_form[2]
    labels = dict(word.split("=", 1) for word in shlex.split(final.all("LABEL")[0].args))
    assert labels["org.opencontainers.image.version"] == VERSION
    assert labels["org.opencontainers.image.title"] == "sfq-proxy"
    pips = []
    for stage in (build, final):
        for run in stage.all("RUN"):
            assert "apt-get" not in run.args
            pips += re.findall(r"pip\"? (?:install|wheel)[^&]*", run.args)
    assert len(pips) == 3
    for pip in pips:
        assert "--no-cache-dir" in pip, pip
    # the dependencies from the lock, every hash checked; the project's wheel adds none
    wheel, locked, project = (pip.strip() for pip in pips)
    assert wheel.endswith('--no-deps --wheel-dir "${WHEELS}" .')
    assert locked.endswith('--require-hashes -r "${WHEELS}/requirements.lock"'), locked
    assert "--no-deps" in project, project
    assert '"${VIRTUAL_ENV}/bin/pip" check' in final.marked("install").args
    assert 'cp requirements.lock "${WHEELS}/"' in build.marked("build").args
    # the logs' format is chosen, not left to whether `docker run -t` gave a terminal
    assert final.env()["SFQ_LOG_FORMAT"] == "json"
    # the state directory of the Kubernetes/compose configs belongs to the image's user
    assert f"chown {IMAGE_UID}:{IMAGE_UID} /var/lib/sfq-proxy" in " ".join(
        run.args for run in final.all("RUN")
    )


def dockerignored(path: str) -> bool:
    """Docker's rule, simplified: the last matching pattern wins, `!` re-includes."""
    ignored = False
    for raw in DOCKERIGNORE.read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        bare = pattern.removeprefix("**/")
        if any(fnmatch(p, pattern) for p in prefixes) or (
            pattern.startswith("**/") and any(fnmatch(part, bare) for part in parts)
        ):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_the_build_inputs_only() -> None:
    build = stages()[0]
    sources = [src for copy in build.all("COPY") for src in copy_args(copy)[1]]
    assert sorted(sources) == [
        "LICENSE", "README.md", "pyproject.toml", "requirements.lock", "sfq_proxy"
    ]  # fmt: skip
    for source in sources:
        assert not dockerignored(source), source
    for path in ROOT.joinpath("sfq_proxy").rglob("*"):
        if "__pycache__" not in path.parts:
            assert not dockerignored(str(path.relative_to(ROOT))), path
    for path in [".venv", ".git", "tests", ".pytest_cache", "sfq_proxy/__pycache__/x.pyc"]:
        assert dockerignored(path), path


def outside_env() -> dict[str, str]:
    """This environment less what would point Python at this checkout or its venv."""
    drop = {"VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH"}
    return {name: value for name, value in os.environ.items() if name not in drop}


def run_marked(stage: Stage, marker: str, cwd: Path, paths: dict[str, Path]) -> None:
    """Run a marked RUN line of ``stage`` like Docker would (`/bin/sh -c`), with the stage's
    ENV, ``paths`` for its path variables, and this venv's python and pip first on PATH."""
    command = stage.marked(marker).args
    for word in shlex.split(re.sub(r"\$\{?\w+\}?", "X", command)):
        assert not word.startswith("/"), f"a path outside the variables: {word} in {command}"
    env = outside_env() | stage.env() | {name: str(path) for name, path in paths.items()}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    result = subprocess.run(
        ["/bin/sh", "-c", command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, f"{command}:\n{result.stdout}{result.stderr}"


def read_line(stream: Any, timeout_s: float) -> str:
    ready, _, _ = select.select([stream], [], [], timeout_s)
    assert ready, "nothing printed in time"
    return stream.readline()


def test_the_image_install_commands_give_a_working_proxy(tmp_path: Path) -> None:
    build, final = stages()
    build_env, final_env = build.env(), final.env()

    # the build stage: its COPYs into a copy of its WORKDIR, then its marked RUN
    src = tmp_path / "src"
    src.mkdir()
    assert build.all("WORKDIR")[0].args == "/src"
    for copy in build.all("COPY"):
        _, sources, dest = copy_args(copy)
        for source in sources:
            target = src / dest / Path(source).name if dest.endswith("/") else src / dest
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(ROOT / source, target)
    built = tmp_path / "wheels"
    run_marked(build, "build", src, {"WHEELS": built})
    [wheel] = built.glob("*.whl")
    assert wheel.name.startswith(f"sfq_proxy-{VERSION}-")

    # the final stage: the wheels copied from the build stage, then its marked RUN
    [copy] = [c for c in final.all("COPY") if copy_args(c)[0].get("from") == build.name]
    _, [source], dest = copy_args(copy)
    assert (source, dest) == (build_env["WHEELS"], final_env["WHEELS"])
    copied, venv = tmp_path / "copied-wheels", tmp_path / "venv"
    shutil.copytree(built, copied)
    run_marked(final, "install", tmp_path, {"WHEELS": copied, "VIRTUAL_ENV": venv})
    assert not copied.exists(), "the wheels are left in the image"
    assert final_env["PATH"].startswith(f"{final_env['VIRTUAL_ENV']}/bin:")
    runtime = subprocess.run(
        [venv / "bin" / "python", "-c", "import uvloop, sfq_proxy; print(sfq_proxy.__file__)"],
        cwd=tmp_path,
        env=outside_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert runtime.returncode == 0, runtime.stderr
    assert runtime.stdout.startswith(str(venv)), runtime.stdout  # not this checkout's
    # the proxy alone: no lab, no simulated server, and their commands say how to get them
    package = Path(runtime.stdout.strip()).parent
    assert (package / "core").is_dir()
    assert (package / "http").is_dir()
    assert not (package / "lab").exists()
    assert not (package / "sim").exists()
    demo = subprocess.run(
        [venv / "bin" / "sfq-proxy", "demo"], env=outside_env(), capture_output=True,
        text=True, timeout=60, check=False,
    )  # fmt: skip
    assert demo.returncode != 0
    assert "pip install 'sfq-proxy[lab]'" in demo.stderr, demo.stderr
    # the versions installed are the lock's, and the package says its own
    freeze = subprocess.run(
        [venv / "bin" / "python", "-m", "pip", "freeze", "--exclude", "sfq-proxy"],
        env=outside_env(), capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert sorted(canonical(line) for line in freeze.split()) == sorted(locked_pins())
    version = subprocess.run(
        [venv / "bin" / "sfq-proxy", "--version"], env=outside_env(), capture_output=True,
        text=True, timeout=60, check=True,
    )  # fmt: skip
    assert version.stdout == f"sfq-proxy {VERSION}\n"

    # the entrypoint's command, on a config whose backend need not exist
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "listen": {"host": "127.0.0.1", "port": 0},
                "keys": [{"key": "sk-test", "org": "test", "classes": ["batch"]}],
                "pools": {
                    "p": {"models": ["m"], "backends": [{"url": "http://127.0.0.1:9", "slots": 1}]}
                },
                "drain_timeout_s": 5,
            }
        )
    )
    assert ENTRYPOINT[:3] == ["sfq-proxy", "serve", "--config"]
    image_env = {name: value for name, value in final_env.items() if name.startswith("SFQ_")}
    proc = subprocess.Popen(
        [venv / "bin" / ENTRYPOINT[0], *ENTRYPOINT[1:3], config],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=outside_env() | image_env,
    )
    try:
        first = read_line(proc.stdout, 60)
        assert first.startswith("{"), first or proc.communicate(timeout=10)[1]
        url = json.loads(first)["url"]  # the banner as the image writes it, JSON
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url)
        with urllib.request.urlopen(f"{url}/healthz", timeout=10) as resp:
            assert resp.status == 200
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            assert b"sfq_" in resp.read()
        proc.send_signal(getattr(signal, final.all("STOPSIGNAL")[0].args))
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "draining" in out
    # the backend on port 9 is down: a warning, as the image writes it, JSON
    [warning] = [json.loads(line) for line in err.splitlines()]
    assert (warning["level"], warning["logger"]) == ("warning", "sfq_proxy.state.pool")
    assert "marked down" in warning["msg"]


def normalised(name: str) -> str:
    """A distribution's name as pip-compile writes it: lower case, runs of -_. as one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


def canonical(pin: str) -> str:
    name, _, version = pin.partition("==")
    return f"{normalised(name)}=={version}"


def locked_pins() -> list[str]:
    """requirements.lock's ``name==version`` lines (those that apply on Linux)."""
    pins = re.findall(r"^([A-Za-z0-9][^\s=;]*==[^\s;\\]+)", LOCK.read_text(), re.M)
    return [canonical(pin) for pin in pins]


def test_the_lock_pins_every_runtime_dependency_within_its_bounds() -> None:
    """requirements.lock, as `make lock` writes it: each of pyproject.toml's runtime
    dependencies and of its tracing extra pinned to a version its bound allows, every pin
    with hashes, no extras' names in them."""
    text = LOCK.read_text()
    assert "#    make lock\n" in text
    entries = re.split(r"\n(?=[A-Za-z0-9])", text[text.index("\n", text.index("make lock")) :])
    pins = {}
    for entry in entries[1:]:
        requirement = Requirement(entry.split("\\")[0].strip())
        assert "--hash=sha256:" in entry, entry
        [spec] = requirement.specifier
        assert spec.operator == "==", entry
        pins[normalised(requirement.name)] = spec.version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # the image can trace: the tracing extra is pinned with the runtime dependencies
    imaged = [*project["dependencies"], *project["optional-dependencies"]["tracing"]]
    for dependency in map(Requirement, imaged):
        name = normalised(dependency.name)
        assert name in pins, f"{dependency.name} is not in requirements.lock: make lock"
        assert dependency.specifier.contains(pins[name]), (dependency, pins[name])
    assert sorted(canonical(f"{n}=={v}") for n, v in pins.items()) == sorted(locked_pins())


# -- Kubernetes -----------------------------------------------------------------------------


def manifest(name: str) -> dict[str, Any]:
    return yaml.safe_load((KUBE / name).read_text())


def kustomization() -> dict[str, Any]:
    return manifest("kustomization.yaml")


def resources() -> dict[str, dict[str, Any]]:
    """kind → the one manifest of that kind."""
    out: dict[str, dict[str, Any]] = {}
    for name in kustomization()["resources"]:
        for doc in yaml.safe_load_all((KUBE / name).read_text()):
            assert doc["kind"] not in out, doc["kind"]
            out[doc["kind"]] = doc
    return out


def container() -> dict[str, Any]:
    [main] = resources()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return main


def env_to_secret() -> dict[str, str]:
    """Deployment env var → the Secret key it is read from."""
    out = {}
    for var in container()["env"]:
        ref = var["valueFrom"]["secretKeyRef"]
        assert ref["name"] == resources()["Secret"]["metadata"]["name"], var
        out[var["name"]] = ref["key"]
    return out


def kube_proxy_config() -> Config:
    """The ConfigMap's config, its key variables filled as the Deployment fills them."""
    secret = resources()["Secret"]["stringData"]
    environ = {name: secret[key] for name, key in env_to_secret().items()}
    text = resources()["ConfigMap"]["data"][CONFIG_PATH.name]
    return parse_config(text, environ=environ, source="deploy/kubernetes/configmap.yaml")


def test_kustomization_lists_every_manifest() -> None:
    listed = kustomization()["resources"]
    assert len(set(listed)) == len(listed)
    on_disk = {p.name for p in KUBE.glob("*.y*ml")} - {"kustomization.yaml"}
    assert set(listed) == on_disk
    assert set(resources()) == {"ConfigMap", "Secret", "Deployment", "Service", "ServiceMonitor"}
    [image] = kustomization()["images"]
    assert image["name"] == container()["image"].split(":")[0]
    assert image["newTag"] == VERSION
    assert container()["image"] == f"{image['name']}:{VERSION}"


def assert_kubernetes_api(docs: Iterable[tuple[str, dict[str, Any]]], version: str) -> None:
    """Each (label, manifest) valid, strictly, for Kubernetes ``version``; a ServiceMonitor
    is a CRD, checked on its own."""
    import kubernetes_validate  # a development dependency: missing, this fails

    for label, doc in docs:
        if doc["kind"] == "ServiceMonitor":
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{label} against Kubernetes {version}: {err}")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_match_the_kubernetes_api(version: str) -> None:
    assert_kubernetes_api(resources().items(), version)


def test_servicemonitor_scrapes_the_service() -> None:
    monitor, service = resources()["ServiceMonitor"], resources()["Service"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint == {"port": "http", "path": "/metrics", "interval": "15s"}
    assert endpoint["port"] in [port["name"] for port in service["spec"]["ports"]]


def test_deployment_is_one_scheduler_behind_the_service() -> None:
    deployment, service = resources()["Deployment"], resources()["Service"]
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    pod_labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["type"] == "ClusterIP"
    [port] = service["spec"]["ports"]
    assert port["name"] == "http"
    assert port["targetPort"] == "http"
    [container_port] = container()["ports"]
    assert container_port["name"] == "http"
    listen = kube_proxy_config().listen
    assert (listen.host, listen.port) == ("0.0.0.0", container_port["containerPort"])
    assert port["port"] == container_port["containerPort"] == 8080  # prometheus.yml's target
    assert "command" not in container()  # the image's entrypoint
    assert "args" not in container()
    assert container()["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container()["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}


def test_deployment_mounts_config_and_writable_state() -> None:
    pod = resources()["Deployment"]["spec"]["template"]["spec"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {mount["mountPath"]: mount for mount in container()["volumeMounts"]}
    config_mount = mounts[str(CONFIG_PATH.parent)]
    assert (
        volumes[config_mount["name"]]["configMap"]["name"]
        == (resources()["ConfigMap"]["metadata"]["name"])
    )
    assert config_mount["readOnly"] is True
    assert set(resources()["ConfigMap"]["data"]) == {CONFIG_PATH.name}
    # every mount names a volume; the state file sits on a writable one
    assert {mount["name"] for mount in mounts.values()} == volumes.keys()
    state_file = kube_proxy_config().calibration.state_file
    assert state_file is not None
    state_mount = mounts[str(Path(state_file).parent)]
    assert not state_mount.get("readOnly", False)
    assert "emptyDir" in volumes[state_mount["name"]]
    assert "/tmp" in mounts
    # non-root, as the image's user, on a read-only root filesystem
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == IMAGE_UID
    assert container()["securityContext"]["readOnlyRootFilesystem"] is True
    assert container()["securityContext"]["allowPrivilegeEscalation"] is False
    assert container()["resources"]["requests"] == {"cpu": "500m", "memory": "512Mi"}


def test_grace_period_outlasts_the_drain() -> None:
    """The kubelet counts the preStop hook in the grace period; after it, the process exits
    within drain_timeout_s + EXIT_WITHIN_S of SIGTERM (tests/runner/test_drain.py measures it):
    the SIGKILL must come later, or it skips the end of the drain."""
    pod = resources()["Deployment"]["spec"]["template"]["spec"]
    command = container()["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pause = float(command[1])
    exits_within = pause + kube_proxy_config().drain_timeout_s + EXIT_WITHIN_S
    assert pod["terminationGracePeriodSeconds"] > exits_within


def test_secret_provides_every_key_the_config_needs() -> None:
    secret = resources()["Secret"]
    for name, key in env_to_secret().items():
        assert key in secret["stringData"], (name, key)
    config = kube_proxy_config()  # parses: every variable is set, no two keys alike
    needed = {key.key_env for key in config.keys if key.key_env}
    needed |= {pool.upstream_key_env for pool in config.pools.values() if pool.upstream_key_env}
    needed.add(config.admin_key_env)
    assert needed == env_to_secret().keys()


def test_configmap_pool_is_the_vllm_statefulset() -> None:
    config = kube_proxy_config()
    [pool] = config.pools.values()
    assert [(b.url, b.slots) for b in pool.backends] == [
        ("http://vllm-0.vllm:8000", 32),
        ("http://vllm-1.vllm:8000", 32),
    ]
    assert config.admin_key_env == "SFQ_ADMIN_KEY"
    assert all(key.key_env for key in config.keys)  # no secret in the ConfigMap


# -- Kubernetes, shared state (the overlay) -------------------------------------------------

KUSTOMIZATION_FIELDS = {
    "apiVersion",
    "kind",
    "resources",
    "images",
    "configMapGenerator",
    "patches",
}


def merge(base: Any, patch: Any) -> Any:
    """A strategic merge patch, as far as the overlay uses it: maps merge key by key; a list
    is only ever set where the base has none (so replacing it is what kustomize does)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            if isinstance(value, list):
                assert key not in base, f"a list patched into an existing one: {key}"
            merged[key] = merge(base[key], value) if key in base else value
        return merged
    return patch


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """What `kubectl kustomize directory` gives, for the features these kustomizations use:
    resources (files and directories), images, configMapGenerator with behavior: replace, and
    patches by path; any other field fails here rather than being ignored."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(spec) <= KUSTOMIZATION_FIELDS, set(spec) - KUSTOMIZATION_FIELDS
    docs: list[dict[str, Any]] = []
    for entry in spec["resources"]:
        path = (directory / entry).resolve()
        docs += kustomize(path) if path.is_dir() else list(yaml.safe_load_all(path.read_text()))

    def find(kind: str, name: str) -> dict[str, Any]:
        [doc] = [d for d in docs if (d["kind"], d["metadata"]["name"]) == (kind, name)]
        return doc

    for generator in spec.get("configMapGenerator", []):
        assert generator["behavior"] == "replace"
        assert generator.keys() == {"name", "behavior", "files"}
        target = find("ConfigMap", generator["name"])
        target["data"] = {
            Path(file).name: (directory / file).read_text() for file in generator["files"]
        }
    for patch in spec.get("patches", []):
        assert patch.keys() == {"path"}
        body = yaml.safe_load((directory / patch["path"]).read_text())
        target = find(body["kind"], body["metadata"]["name"])
        docs[docs.index(target)] = merge(target, body)
    for image in spec.get("images", []):
        for doc in docs:
            pod = doc.get("spec", {}).get("template", {}).get("spec", {})
            for box in pod.get("containers", []):
                if box["image"].split(":")[0] == image["name"]:
                    box["image"] = f"{image['newName']}:{image['newTag']}"
    return docs


def shared() -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) → the overlay's built manifest."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for doc in kustomize(SHARED):
        key = (doc["kind"], doc["metadata"]["name"])
        assert key not in out, key
        out[key] = doc
    return out


def shared_proxy() -> dict[str, Any]:
    return shared()["Deployment", resources()["Deployment"]["metadata"]["name"]]


def shared_redis() -> tuple[dict[str, Any], dict[str, Any]]:
    """The trial Redis: its Deployment and its Service (the overlay's other ones)."""
    proxy = resources()["Deployment"]["metadata"]["name"]
    [deployment] = [d for (k, n), d in shared().items() if k == "Deployment" and n != proxy]
    proxy = resources()["Service"]["metadata"]["name"]
    [service] = [d for (k, n), d in shared().items() if k == "Service" and n != proxy]
    return deployment, service


def redis_pod_labels() -> dict[str, str]:
    return shared_redis()[0]["spec"]["template"]["metadata"]["labels"]


def shared_proxy_config() -> Config:
    """The overlay's ConfigMap's config, its variables filled as in the base."""
    secret = resources()["Secret"]["stringData"]
    environ = {name: secret[key] for name, key in env_to_secret().items()}
    configmap = shared()["ConfigMap", resources()["ConfigMap"]["metadata"]["name"]]
    text = configmap["data"][CONFIG_PATH.name]
    return parse_config(text, environ=environ, source="deploy/kubernetes-shared/config.yaml")


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_overlay_builds_on_the_unchanged_base() -> None:
    spec = yaml.safe_load((SHARED / "kustomization.yaml").read_text())
    assert (SHARED / spec["resources"][0]).resolve() == KUBE
    listed = {Path(entry).name for entry in spec["resources"][1:]}
    listed |= {patch["path"] for patch in spec["patches"]}
    listed |= {file for generator in spec["configMapGenerator"] for file in generator["files"]}
    on_disk = {p.name for p in SHARED.glob("*.y*ml")} - {"kustomization.yaml"}
    assert listed == on_disk
    base = {(doc["kind"], doc["metadata"]["name"]) for doc in resources().values()}
    assert shared().keys() == base | {
        ("PodDisruptionBudget", "sfq-proxy"),
        ("Deployment", "sfq-redis"),
        ("Service", "sfq-redis"),
    }
    # what the overlay leaves alone is the base's
    for key in base - {("Deployment", "sfq-proxy"), ("ConfigMap", "sfq-proxy-config")}:
        assert shared()[key] == resources()[key[0]], key


def test_overlay_build_is_kubectl_kustomizes() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:  # not a development dependency: the build above is all there is
        return
    result = subprocess.run(
        [kubectl, "kustomize", str(SHARED)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    built = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(result.stdout)}
    assert built == shared()


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_overlay_manifests_match_the_kubernetes_api(version: str) -> None:
    assert_kubernetes_api(
        ((f"{kind} {name}", doc) for (kind, name), doc in shared().items()), version
    )


def test_overlay_rolls_replicas_of_one_fairness_domain() -> None:
    spec = shared_proxy()["spec"]
    assert spec["replicas"] >= 2
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    pod_labels = spec["template"]["metadata"]["labels"]
    [spread] = spec["template"]["spec"]["topologySpreadConstraints"]
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"  # a one-node cluster still runs
    assert selects(spread["labelSelector"]["matchLabels"], pod_labels)
    # the PodDisruptionBudget covers exactly the proxy pods and leaves one serving
    pdb = shared()["PodDisruptionBudget", "sfq-proxy"]
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels)
    assert not selects(pdb["spec"]["selector"]["matchLabels"], redis_pod_labels())
    # the base stays one memory-mode scheduler (test_deployment_is_one_scheduler_...)
    assert resources()["Deployment"]["spec"]["replicas"] == 1
    assert kube_proxy_config().state is None  # memory


def test_overlay_config_is_the_base_config_with_state_in_its_redis() -> None:
    config = shared_proxy_config()
    assert isinstance(config.state, RedisState)
    assert config.state.lease_ttl_s == 5
    url = urlsplit(config.redis_url() or "")
    deployment, service = shared_redis()
    [port] = service["spec"]["ports"]
    assert (url.scheme, url.hostname, url.port) == (
        "redis",
        service["metadata"]["name"],
        port["port"],
    )
    assert url.path == "/0"
    # the Redis Service selects the Redis pod, and nothing selects across
    pod_labels = redis_pod_labels()
    assert selects(service["spec"]["selector"], pod_labels)
    assert selects(deployment["spec"]["selector"]["matchLabels"], pod_labels)
    proxy_labels = shared_proxy()["spec"]["template"]["metadata"]["labels"]
    assert not selects(service["spec"]["selector"], proxy_labels)
    assert not selects(resources()["Service"]["spec"]["selector"], pod_labels)
    # the base's config, plus the state section
    base_text = resources()["ConfigMap"]["data"][CONFIG_PATH.name]
    overlay = yaml.safe_load((SHARED / "config.yaml").read_text())
    assert overlay.pop("state") == {"redis": "redis://sfq-redis:6379/0", "lease_ttl_s": 5}
    assert overlay == yaml.safe_load(base_text)


def test_overlay_redis_is_a_pinned_in_memory_trial_instance() -> None:
    deployment, _ = shared_redis()
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    [redis] = spec["template"]["spec"]["containers"]
    assert re.fullmatch(r"redis:7\.0\.\d+", redis["image"]), redis["image"]
    args = redis["args"]
    assert args[0] == "redis-server"
    assert args[args.index("--save") + 1] == ""
    assert args[args.index("--appendonly") + 1] == "no"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"  # leases never evicted
    assert {"requests", "limits"} <= redis["resources"].keys()
    assert "redis-cli ping" in " ".join(redis["readinessProbe"]["exec"]["command"])
    [port] = redis["ports"]
    assert port == {"name": "redis", "containerPort": 6379, "protocol": "TCP"}
    assert redis["securityContext"]["readOnlyRootFilesystem"] is True
    head = (SHARED / "redis.yaml").read_text().split("apiVersion:")[0]
    for words in ("TRIALS", "managed", "Sentinel", "cluster: true", "redis_env", "503"):
        assert words in head, words


def test_overlay_grace_period_outlasts_the_drain() -> None:
    pod = shared_proxy()["spec"]["template"]["spec"]
    [main] = pod["containers"]
    assert main == container()  # the patch leaves the container alone: probes, env, mounts
    pause = float(main["lifecycle"]["preStop"]["exec"]["command"][1])
    exits_within = pause + shared_proxy_config().drain_timeout_s + EXIT_WITHIN_S
    assert pod["terminationGracePeriodSeconds"] > exits_within
    assert main["readinessProbe"]["httpGet"]["path"] == "/readyz"  # fails while Redis does


# -- Docker Compose -------------------------------------------------------------------------


def interpolate(text: str) -> str:
    """Compose's `${VAR:-default}`, with nothing set: the defaults."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text)


def compose() -> dict[str, Any]:
    return yaml.safe_load(interpolate(COMPOSE_FILE.read_text()))


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]


def compose_proxy_config() -> Config:
    environ = services()["sfq-proxy"]["environment"]
    return parse_config(
        (COMPOSE_DIR / "config.yaml").read_text(), environ=environ, source="config.yaml"
    )


def flags(argv: list[str]) -> dict[str, str]:
    """`--name=value` and `--name value` arguments (repeated ones: the last)."""
    out: dict[str, str] = {}
    for i, word in enumerate(argv):
        if word.startswith("--"):
            name, eq, value = word[2:].partition("=")
            out[name] = value if eq else argv[i + 1]
    return out


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path → host path, for every bind mount of a service."""
    out = {}
    for volume in service.get("volumes", []):
        host, container_path = volume.split(":")[:2]
        assert host.startswith("."), f"not a path relative to the compose file: {volume}"
        out[container_path] = (COMPOSE_DIR / host).resolve()
    return out


@pytest.mark.parametrize("profile", [[], ["--profile", "demo"], ["--profile", "shared"]])
def test_docker_compose_config_accepts_the_file(profile: list[str]) -> None:
    binary = need_tool("docker-compose")  # Debian's: `make tools`
    result = subprocess.run(
        [binary, "-f", str(COMPOSE_FILE), *profile, "config", "-q"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_services_and_mounts() -> None:
    assert services().keys() == {
        *("sfq-proxy", "sim-1", "sim-2", "loadgen", "prometheus", "grafana"),
        *("redis", "sfq-proxy-a", "sfq-proxy-b"),
    }
    for name, service in services().items():
        for host in bind_mounts(service).values():
            assert host.exists(), (name, host)
        if "build" in service:
            assert (COMPOSE_DIR / service["build"]["context"]).resolve() == ROOT
            assert service["build"]["dockerfile"] == DOCKERFILE.name
        else:  # a pinned third-party image
            tag = service["image"].rpartition(":")[2]
            assert re.fullmatch(r"v?\d+\.\d+\.\d+", tag), service["image"]
    proxy = services()["sfq-proxy"]
    assert bind_mounts(proxy)[str(CONFIG_PATH)] == COMPOSE_DIR / "config.yaml"
    assert "entrypoint" not in proxy  # the image's
    assert proxy["ports"] == ["8080:8080"]
    grace = re.fullmatch(r"(\d+)s", proxy["stop_grace_period"])
    assert grace
    assert int(grace[1]) > compose_proxy_config().drain_timeout_s + EXIT_WITHIN_S


def test_compose_proxy_config_serves_the_sims() -> None:
    config = compose_proxy_config()
    assert (config.listen.host, config.listen.port) == ("0.0.0.0", 8080)
    [pool] = config.pools.values()
    assert pool.models == [DEFAULT_MODEL]  # what sim-backend serves without --model
    hosts = []
    for backend in pool.backends:
        url = urlsplit(backend.url)
        hosts.append(url.hostname)
        sim = services()[url.hostname]
        argv = [*sim["entrypoint"], *sim.get("command", [])]
        assert argv[:2] == ["sfq-proxy", "sim-backend"]
        assert "model" not in flags(argv)
        assert flags(argv)["host"] == "0.0.0.0"
        assert int(flags(argv)["port"]) == url.port
        assert int(flags(argv)["max-num-seqs"]) == backend.slots
        health = " ".join(sim["healthcheck"]["test"])
        assert f"http://127.0.0.1:{url.port}/health'" in health
    assert hosts == ["sim-1", "sim-2"]


def test_compose_loadgen_plays_the_scenario_with_the_configs_keys() -> None:
    loadgen = services()["loadgen"]
    assert loadgen["profiles"] == ["demo"]
    argv = loadgen["entrypoint"]
    assert argv[:2] == ["sfq-proxy", "loadgen"]
    scenario_path = Path(argv[2])
    scenario_host = bind_mounts(loadgen)[str(scenario_path.parent)] / scenario_path.name
    scenario = yaml.safe_load(scenario_host.read_text())
    url = urlsplit(flags(argv)["url"])
    assert url.hostname == "sfq-proxy"
    assert url.port == compose_proxy_config().listen.port
    # one --key per team; each key is the config's key of the team's org and class
    team_keys = dict(word.removeprefix("--key=").split("=", 1) for word in argv if "--key=" in word)
    assert team_keys.keys() == scenario["teams"].keys()
    keys = yaml.safe_load((COMPOSE_DIR / "config.yaml").read_text())["keys"]
    by_secret = {key["key"]: key for key in keys}
    for team, spec in scenario["teams"].items():
        key = by_secret[team_keys[team]]
        assert (key["org"], key["classes"][0]) == (spec["org"], spec["class"]), team
    # arrivals and the sims' engine run at the same speed-up
    for sim in ("sim-1", "sim-2"):
        assert flags(services()[sim]["command"])["time-scale"] == flags(argv)["time-scale"]
    assert loadgen["depends_on"]["sfq-proxy"]["condition"] == "service_healthy"


def test_compose_observability_points_at_its_services() -> None:
    prometheus, grafana = services()["prometheus"], services()["grafana"]
    mounted = bind_mounts(prometheus)
    scrape = yaml.safe_load((mounted["/etc/prometheus"] / "prometheus.yml").read_text())
    flag = [w for w in prometheus["command"] if w.startswith("--config.file=")]
    assert flag == ["--config.file=/etc/prometheus/prometheus.yml"]
    for job in scrape["scrape_configs"]:
        for static in job["static_configs"]:
            for target in static["targets"]:
                host, _, port = target.partition(":")
                assert host in services(), target
                assert int(port) == compose_proxy_config().listen.port
    grafana_mounts = bind_mounts(grafana)
    assert grafana_mounts["/etc/grafana/provisioning"] == ROOT / "deploy/grafana/provisioning"
    assert grafana_mounts["/var/lib/grafana/dashboards"] == ROOT / "deploy/grafana/dashboards"
    sources = grafana_mounts["/etc/grafana/provisioning"] / "datasources" / "prometheus.yml"
    [source] = yaml.safe_load(sources.read_text())["datasources"]
    assert urlsplit(source["url"]).hostname in services()
    env = grafana["environment"]
    assert (env["GF_AUTH_ANONYMOUS_ENABLED"], env["GF_AUTH_ANONYMOUS_ORG_ROLE"]) == (
        "true",
        "Viewer",
    )
    home = Path(env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert (grafana_mounts[str(home.parent)] / home.name).exists()


def test_compose_shared_profile_is_two_replicas_on_its_redis() -> None:
    redis = services()["redis"]
    assert redis["profiles"] == ["shared"]
    assert redis["command"] == ["redis-server", "--save", "", "--appendonly", "no"]
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])
    plain = yaml.safe_load((COMPOSE_DIR / "config.yaml").read_text())
    published = []
    for name in ("sfq-proxy-a", "sfq-proxy-b"):
        replica = services()[name]
        assert replica["profiles"] == ["shared"]
        assert replica["build"] == services()["sfq-proxy"]["build"]
        assert bind_mounts(replica)[str(CONFIG_PATH)] == COMPOSE_DIR / "config-shared.yaml"
        assert replica["depends_on"]["redis"] == {"condition": "service_healthy"}
        for sim in ("sim-1", "sim-2"):
            assert replica["depends_on"][sim] == {"condition": "service_healthy"}
        config = parse_config(
            (COMPOSE_DIR / "config-shared.yaml").read_text(),
            environ=replica["environment"],
            source="config-shared.yaml",
        )
        assert isinstance(config.state, RedisState)
        url = urlsplit(config.redis_url() or "")
        assert (url.scheme, url.hostname, url.port) == ("redis", "redis", 6379)
        grace = re.fullmatch(r"(\d+)s", replica["stop_grace_period"])
        assert grace
        assert int(grace[1]) > config.drain_timeout_s + EXIT_WITHIN_S
        [ports] = replica["ports"]
        host, _, inside = ports.partition(":")
        assert int(inside) == config.listen.port
        published.append(host)
    assert len({*published, "8080"}) == 3  # beside the memory-mode proxy's port
    # the plain config plus the state section
    shared_config = yaml.safe_load((COMPOSE_DIR / "config-shared.yaml").read_text())
    assert shared_config.pop("state") == {"redis": "redis://redis:6379/0", "lease_ttl_s": 5}
    assert shared_config == plain
