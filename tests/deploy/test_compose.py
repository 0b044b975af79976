"""The GPU node's docker-compose.yaml, its image and .env.example keep the promises of README.md and
docs/operations.md.

The file is read as Compose reads it: `docker-compose config` (Debian's Compose v1, which
scripts/install-test-packages.sh installs; no Docker engine needed) resolves the variables, the anchors and the
relative paths, on a copy without the top-level `name:` (v1 rejects it; `-p` gives it). `docker compose config`
(v2, the node's) runs too where the plugin is installed. The whole stack runs in `make test-deploy`
(tests/deploy_stack/).
"""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yaml"
ENV_EXAMPLE = ROOT / ".env.example"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
MONITORING = ROOT / "deploy" / "monitoring"

AIRFLOW_SERVICES = {"airflow-init", "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor",
                    "airflow-triggerer", "airflow-worker", "airflow-gpu-worker"}
LONG_RUNNING = (AIRFLOW_SERVICES - {"airflow-init"}) | {"postgres", "redis"}
SECRETS = {"POSTGRES_PASSWORD", "AIRFLOW_FERNET_KEY", "AIRFLOW_JWT_SECRET", "AIRFLOW_API_SECRET_KEY",
           "AIRFLOW_ADMIN_PASSWORD", "DFLASH_SGLANG_API_KEY", "DFLASH_METRICS_TOKEN"}
SECRET_NAME = re.compile(r"(PASSWORD|SECRET|_KEY|TOKEN)$")  # names of values that are secrets
# A reference in the file's text: ${VAR}, ${VAR:-default}, ${VAR:?message} ("$$" is a literal "$"). Only to read
# what the file says; Compose itself does the substitution (compose_config).
REF = re.compile(r"(?<!\$)\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")
COMPOSE_V1 = shutil.which("docker-compose")
needs_compose = pytest.mark.skipif(COMPOSE_V1 is None, reason="docker-compose (Debian's Compose v1) is not "
                                   "installed: scripts/install-test-packages.sh installs it")


class ComposeRefused(Exception):
    pass


def compose_config(env: dict[str, str], tmp: Path) -> dict:
    """The file as `docker-compose config` resolves it with `env` as the .env (and nothing from this process)."""
    copy, env_file = tmp / "docker-compose.yaml", tmp / "env"
    copy.write_text(re.sub(r"(?m)^name: .*\n", "", COMPOSE.read_text(), count=1))
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    done = subprocess.run([COMPOSE_V1, "--project-directory", str(ROOT), "--env-file", str(env_file), "-p",
                           "dflash-regen", "-f", str(copy), "config"], capture_output=True, text=True, check=False,
                          env={"PATH": "/usr/bin:/bin"}, timeout=120)
    if done.returncode != 0:
        raise ComposeRefused(done.stderr)
    return yaml.safe_load(done.stdout)


def read_env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if re.match(r"^[A-Z0-9_]+=", line))
    return {name: value for name, value in pairs}


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def env_example() -> dict[str, str]:
    return read_env_file(ENV_EXAMPLE)


@pytest.fixture(scope="module")
def filled_env(env_example) -> dict[str, str]:
    """.env.example with every secret filled in, as an operator's .env."""
    return {name: value or f"test-{name.lower()}-0123456789abcdef" for name, value in env_example.items()}


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    """compose_config(env) in a fresh folder each call."""
    if COMPOSE_V1 is None:
        pytest.skip("docker-compose (Debian's Compose v1) is not installed: scripts/install-test-packages.sh "
                    "installs it")
    return lambda env: compose_config(env, tmp_path_factory.mktemp("compose"))


@pytest.fixture(scope="module")
def services(config, filled_env) -> dict[str, dict]:
    return config(filled_env)["services"]


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    assert isinstance(env, dict), "write environment as a mapping so the common anchor can be merged"
    return env


def mounts(service: dict) -> dict[str, tuple[str, str]]:
    """Container path -> (source, mode) of a service's volumes as Compose resolves them (absolute host paths)."""
    result = {}
    for spec in service.get("volumes", []):
        source, target, *mode = spec.split(":")
        result[target] = (source, mode[0] if mode else "rw")
    return result


# ------------------------------------------------------------------------------------------ services
def test_required_services_are_present(raw):
    assert AIRFLOW_SERVICES | {"postgres", "redis"} <= set(raw["services"])


def test_every_airflow_service_uses_the_common_image_and_environment(raw):
    common = raw["x-airflow-common"]
    assert common["build"]["dockerfile"] == "deploy/Dockerfile" and (ROOT / common["build"]["context"]).is_dir()
    for name in AIRFLOW_SERVICES:
        service = raw["services"][name]
        assert (service["image"], service["build"]) == (common["image"], common["build"]), name
        env = environment(service)
        assert {k: env.get(k) for k in common["environment"]} == common["environment"], name
        assert set(service["volumes"]) >= set(common["volumes"]), name


def test_airflow_runs_celery_on_postgres_and_redis(services):
    env = environment(services["airflow-scheduler"])
    assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert re.match(r"postgresql\+psycopg2://airflow:[^@]+@postgres/airflow$",
                    env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])
    assert re.match(r"db\+postgresql://airflow:[^@]+@postgres/airflow$", env["AIRFLOW__CELERY__RESULT_BACKEND"])
    assert env["AIRFLOW__CELERY__BROKER_URL"].startswith("redis://redis:")
    assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://airflow-apiserver:8080/execution/"
    commands = {name: services[name].get("command") for name in AIRFLOW_SERVICES}
    assert commands["airflow-apiserver"] == "api-server" and commands["airflow-scheduler"] == "scheduler"
    assert commands["airflow-dag-processor"] == "dag-processor" and commands["airflow-triggerer"] == "triggerer"
    assert commands["airflow-worker"] == "celery worker"


def test_init_migrates_the_database_and_writes_the_admin_login(raw, services):
    script = "\n".join(services["airflow-init"]["command"])
    assert "airflow db migrate" in script
    env = environment(services["airflow-init"])
    assert env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS"] == "admin:admin"
    assert env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"] in script
    assert 'os.environ["AIRFLOW_ADMIN_PASSWORD"]' in script
    password = environment(raw["services"]["airflow-init"])["AIRFLOW_ADMIN_PASSWORD"]
    assert password.startswith("${AIRFLOW_ADMIN_PASSWORD:?")


# ------------------------------------------------------------------------------------------ the GPU worker
def test_gpu_worker_reserves_every_nvidia_gpu(services):
    devices = services["airflow-gpu-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1
    assert devices[0]["driver"] == "nvidia" and devices[0]["count"] == "all" and devices[0]["capabilities"] == ["gpu"]
    gpu_holders = {name for name, s in services.items() if "devices" in str(s.get("deploy", ""))}
    assert gpu_holders == {"airflow-gpu-worker", "airflow-gpu-worker-2"}


def test_a_second_gpu_node_is_a_worker_on_its_own_queue_against_node_ones_services(config, filled_env):
    """Started alone on the second machine (profile, --no-deps): Redis, Postgres and the api-server are node 1's."""
    env = {**filled_env, "DFLASH_CONTROL_HOST": "10.0.0.1", "DFLASH_NODES": '[{"name": "a"}, {"name": "b"}]'}
    services = config(env)["services"]
    first, second = services["airflow-gpu-worker"], services["airflow-gpu-worker-2"]
    assert second["profiles"] == ["second-node"]
    assert second["command"].split() == ["celery", "worker", "--queues", "gpu-node-2"] != first["command"].split()
    assert second["deploy"] == first["deploy"] and mounts(second) == mounts(first)
    env2 = environment(second)
    assert env2["AIRFLOW__CELERY__BROKER_URL"] == "redis://10.0.0.1:6379/0"
    assert env2["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://10.0.0.1:8080/execution/"
    assert "@10.0.0.1/airflow" in env2["AIRFLOW__CELERY__RESULT_BACKEND"]
    for name in AIRFLOW_SERVICES | {"airflow-gpu-worker-2"}:  # every component parses the same node list
        assert environment(services[name])["DFLASH_NODES"] == env["DFLASH_NODES"], name


def size_in_gb(text: str) -> float:
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)b?", str(text).lower()).groups()
    return float(number) * {"": 1e-9, "k": 1e-6, "m": 1e-3, "g": 1, "t": 1e3}[unit]


def test_gpu_worker_has_the_node_ram_disk_for_staging(services):
    """stage_weights copies the ~55 GB model to /dev/shm: the host's RAM disk, or a private one as large."""
    worker = services["airflow-gpu-worker"]
    shm = mounts(worker).get("/dev/shm")
    assert shm == ("/dev/shm", "rw") or size_in_gb(worker.get("shm_size", "64m")) >= 100


def test_gpu_worker_mounts_the_sglang_venv_and_models_read_only(services):
    worker = services["airflow-gpu-worker"]
    env, volumes = environment(worker), mounts(worker)
    interpreter = env["DFLASH_SERVER_COMMAND"].split()[0]
    venv = next(target for target in volumes if interpreter.startswith(target + "/"))
    assert volumes[venv][1] == "ro"
    models = next(target for target in volumes if env["DFLASH_MODEL_SOURCE"].startswith(target + "/"))
    assert volumes[models][1] == "ro"
    # The venv is built by the setup service, with the image's Python, into the same host dir and path.
    builder = services["sglang-venv"]
    assert builder["image"] == worker["image"] and builder["profiles"] == ["setup"]
    assert mounts(builder)[venv] == (volumes[venv][0], "rw")
    assert builder["entrypoint"][-2:] == ["/opt/dflash-regen/scripts/build-sglang-venv.sh", venv]
    assert (ROOT / "scripts" / "build-sglang-venv.sh").is_file()
    # ... from the version's lock, which the script looks for beside its own folder: ../deploy/sglang-locks.
    assert mounts(builder)["/opt/dflash-regen/deploy/sglang-locks"] == (str(ROOT / "deploy" / "sglang-locks"), "ro")


def test_every_airflow_container_sees_the_same_output_root(services):
    roots = {name: environment(services[name])["DFLASH_OUTPUT_ROOT"] for name in AIRFLOW_SERVICES}
    assert len(set(roots.values())) == 1
    root = roots["airflow-gpu-worker"]
    assert len({mounts(services[name])[root] for name in AIRFLOW_SERVICES}) == 1


@pytest.mark.parametrize("queue", [None, "gpu-node-2"])
def test_gpu_worker_listens_on_the_queue_the_dag_is_parsed_with(config, filled_env, queue):
    env = dict(filled_env) if queue is None else {**filled_env, "DFLASH_WORKER_QUEUE": queue}
    services = config(env)["services"]
    expected = queue or filled_env["DFLASH_WORKER_QUEUE"]
    assert services["airflow-gpu-worker"]["command"].split() == ["celery", "worker", "--queues", expected]
    # The dag-processor parses the DAG (the queue is fixed there); the workers parse it again to run tasks.
    for name in AIRFLOW_SERVICES:
        assert environment(services[name])["DFLASH_WORKER_QUEUE"] == expected, name
    assert "--queues" not in services["airflow-worker"]["command"]  # the CPU worker keeps the default queue


def test_sglang_ports_are_not_published(services):
    """The servers listen on the GPU worker's loopback; only tasks running there talk to them."""
    assert "ports" not in services["airflow-gpu-worker"]
    published = [p for s in services.values() for p in s.get("ports", [])]
    assert not any(re.search(r":300\d\d(/tcp)?$", str(p)) for p in published), published


# ------------------------------------------------------------------------------------------ monitoring profile
def container_file(service: dict, path: str) -> Path:
    """The repository file (or folder) a service's bind mount shows at container path `path`."""
    for target, (source, _) in mounts(service).items():
        if path == target or path.startswith(target + "/"):
            assert Path(source).is_relative_to(ROOT), f"{target} is not a repository file: {source}"
            return Path(source) / path[len(target):].lstrip("/")
    raise AssertionError(f"nothing is mounted at {path}")


def test_prometheus_scrapes_every_server_on_the_gpu_workers_loopback(services):
    from dflash_regen.settings.deployment import Deployment
    from dflash_regen.settings.params import defaults

    prometheus = services["prometheus"]
    assert prometheus["profiles"] == ["monitoring"] and "ports" not in prometheus
    assert prometheus["network_mode"] == "service:airflow-gpu-worker"  # the servers' loopback is its own
    script = "\n".join(prometheus["entrypoint"])
    config_path = re.search(r"--config\.file=(\S+)", script)[1]
    config = yaml.safe_load(container_file(prometheus, config_path).read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets = [t for c in jobs["sglang"]["static_configs"] for t in c["targets"]]
    base, servers = Deployment().base_port, defaults()["num_servers"]  # a node's 7 GPUs, one server each
    assert targets == [f"127.0.0.1:{base + i}" for i in range(servers)]
    assert mounts(prometheus)["/prometheus"][0] in {"prometheus-data"}  # the series outlive a restart


def test_prometheus_reads_the_pipelines_metrics_with_the_api_servers_token(raw, services):
    from dflash_regen.ui.metrics import URL_PREFIX

    prometheus = services["prometheus"]
    script = "\n".join(prometheus["entrypoint"])
    config = yaml.safe_load(container_file(prometheus, re.search(r"--config\.file=(\S+)", script)[1]).read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "dflash-regen")
    assert job["metrics_path"] == URL_PREFIX + "/metrics"
    host, port = job["static_configs"][0]["targets"][0].split(":")
    assert host == "airflow-apiserver" and services[host]["command"] == "api-server"
    assert services[host]["ports"][0].endswith(f":{port}/tcp")
    token_file = job["authorization"]["credentials_file"]
    # `config` prints "$$" (a literal "$" to the shell, not a variable of compose's) as it reads it
    assert f'printf \'%s\' "$$DFLASH_METRICS_TOKEN" > {token_file}' in script
    for name in ("prometheus", "airflow-apiserver"):
        assert environment(raw["services"][name])["DFLASH_METRICS_TOKEN"].startswith("${DFLASH_METRICS_TOKEN:?")


def test_grafana_is_provisioned_with_prometheus_and_the_dashboards(services):
    grafana, prometheus = services["grafana"], services["prometheus"]
    assert grafana["profiles"] == ["monitoring"] and grafana["ports"] == ["127.0.0.1:3000:3000/tcp"]
    sources = yaml.safe_load(container_file(grafana, "/etc/grafana/provisioning/datasources/prometheus.yaml")
                             .read_text())["datasources"]
    assert len(sources) == 1 and sources[0]["type"] == "prometheus" and sources[0]["isDefault"]
    listen = re.search(r"--web\.listen-address=\S*:(\d+)", "\n".join(prometheus["entrypoint"]))[1]
    worker = prometheus["network_mode"].removeprefix("service:")
    assert sources[0]["url"] == f"http://{worker}:{listen}"  # Prometheus answers at the worker's name
    providers = yaml.safe_load(container_file(grafana, "/etc/grafana/provisioning/dashboards/dashboards.yaml")
                               .read_text())["providers"]
    folder = container_file(grafana, next(p for p in providers if p["name"] == "dflash-regen")["options"]["path"])
    dashboards = {p.relative_to(folder).as_posix(): json.loads(p.read_text()) for p in folder.rglob("*.json")}
    assert set(dashboards) == {"sglang/fleet.json", "dflash-regen/pipeline.json"}
    assert len({d["uid"] for d in dashboards.values()}) == 2
    for name, dashboard in dashboards.items():
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == sources[0]["uid"], (name, panel["title"])
    home = environment(grafana)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert container_file(grafana, home) == folder / "dflash-regen" / "pipeline.json"


SGLANG_DASHBOARD = re.compile(r"https://raw\.githubusercontent\.com/sgl-project/sglang/[0-9a-f]{40}/"
                              r"examples/monitoring/grafana/dashboards/json/sglang-dashboard\.json")


def test_sglangs_own_dashboard_is_downloaded_pinned_into_a_folder_grafana_provisions(services):
    grafana, download = services["grafana"], services["grafana-dashboards"]
    assert download["profiles"] == ["monitoring"] and "restart" not in download  # one-shot
    env = environment(download)
    assert SGLANG_DASHBOARD.fullmatch(env["SGLANG_DASHBOARD_URL"])  # a commit, not a branch
    assert re.fullmatch(r"[0-9a-f]{64}", env["SGLANG_DASHBOARD_SHA256"])
    shell, script, dest = download["entrypoint"]
    assert shell == "sh" and container_file(download, script) == MONITORING / "download-sglang-dashboard.sh"
    volume = mounts(download)[dest][0]
    assert volume in {"grafana-sglang-dashboard"} and mounts(download)[dest][1] == "rw"
    served = {target for target, (source, mode) in mounts(grafana).items() if source == volume and mode == "ro"}
    providers = yaml.safe_load(container_file(grafana, "/etc/grafana/provisioning/dashboards/dashboards.yaml")
                               .read_text())["providers"]
    assert served and served <= {p["options"]["path"] for p in providers}
    assert "grafana-dashboards" not in grafana.get("depends_on", {})  # the provider rescans: Grafana never waits
    # SGLang's file itself is never part of this repository
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "sglang-dashboard.json" not in tracked


def run_download(dest: Path, url: str, sha256: str) -> subprocess.CompletedProcess:
    assert shutil.which("wget"), "the download script needs wget (scripts/install-test-packages.sh installs it)"
    return subprocess.run(["sh", str(MONITORING / "download-sglang-dashboard.sh"), str(dest)], check=False,
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "SGLANG_DASHBOARD_URL": url, "SGLANG_DASHBOARD_SHA256": sha256})


def test_the_download_installs_only_the_pinned_bytes(tmp_path):
    """The script against a real HTTP server on loopback: the file with the pinned sha256 is installed (and not
    downloaded again), other bytes or no answer install nothing."""
    import hashlib
    import http.server
    import threading

    from conftest import free_port_block

    served, requests_seen = tmp_path / "served", []
    served.mkdir()
    body = json.dumps({"title": "a dashboard", "panels": []}).encode()
    (served / "dashboard.json").write_bytes(body)
    (served / "tampered.json").write_bytes(body + b" ")

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(served), **kwargs)

        def log_message(self, *args):
            requests_seen.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port_block(1)), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base, sha256 = f"http://127.0.0.1:{server.server_port}", hashlib.sha256(body).hexdigest()
    dest = tmp_path / "volume"
    dest.mkdir()
    try:
        refused = run_download(dest, f"{base}/tampered.json", sha256)
        assert refused.returncode == 1 and f"not the pinned {sha256}" in refused.stderr
        assert list(dest.iterdir()) == []  # nothing installed, no partial file left
        installed = run_download(dest, f"{base}/dashboard.json", sha256)
        assert installed.returncode == 0, installed.stderr
        assert [p.name for p in dest.iterdir()] == ["sglang-dashboard.json"]
        assert (dest / "sglang-dashboard.json").read_bytes() == body
        seen = len(requests_seen)
        assert run_download(dest, f"{base}/dashboard.json", sha256).returncode == 0
        assert len(requests_seen) == seen  # in place: not downloaded again
    finally:
        server.shutdown()
        server.server_close()
    (dest / "sglang-dashboard.json").unlink()
    unreachable = run_download(dest, f"{base}/dashboard.json", sha256)  # the server is gone
    assert unreachable.returncode == 1 and "could not download" in unreachable.stderr
    assert list(dest.iterdir()) == []


# ------------------------------------------------------------------------------------------ api-server, health
def test_api_server_publishes_port_8080_on_loopback_by_default(services):
    assert services["airflow-apiserver"]["ports"] == ["127.0.0.1:8080:8080/tcp"]
    assert "localhost:8080" in " ".join(services["airflow-apiserver"]["healthcheck"]["test"])


def test_long_running_services_have_healthchecks_and_restart(services):
    for name in LONG_RUNNING:
        check = services[name].get("healthcheck", {})
        assert check.get("test") and check["test"][0] in ("CMD", "CMD-SHELL"), name
        assert services[name].get("restart") == "always", name
    assert "restart" not in services["airflow-init"]


def test_depends_on_names_real_services_with_valid_conditions(services):
    for name, service in services.items():
        for target, spec in service.get("depends_on", {}).items():
            assert target in services, f"{name} depends on unknown service {target}"
            condition = spec["condition"]
            if condition == "service_healthy":
                assert "healthcheck" in services[target], f"{name} waits for {target} to be healthy: it has no check"
            else:
                assert (condition, target) == ("service_completed_successfully", "airflow-init"), (name, target)
    for name in AIRFLOW_SERVICES:
        depends = services[name]["depends_on"]
        assert depends["postgres"]["condition"] == depends["redis"]["condition"] == "service_healthy", name
        if name != "airflow-init":
            assert depends["airflow-init"]["condition"] == "service_completed_successfully", name
    for worker in ("airflow-worker", "airflow-gpu-worker"):  # tasks talk to the api-server's execution API
        assert services[worker]["depends_on"]["airflow-apiserver"]["condition"] == "service_healthy"


def test_images_are_pinned(services):
    for name, service in services.items():
        repository, _, tag = service["image"].rpartition(":")
        assert repository and "/" not in tag and tag not in ("", "latest"), f"{name}: {service['image']}"


# ------------------------------------------------------------------------------------------ secrets
def test_secrets_are_references_that_compose_requires(raw, services):
    text = COMPOSE.read_text()
    for m in REF.finditer(text):
        if m["name"] in SECRETS:
            assert m["op"] == ":?", f"{m[0]}: a secret must be required (':?'), never defaulted"
    for name, service in raw["services"].items():
        for key, value in environment(service).items():
            value = str(value)
            if SECRET_NAME.search(key):
                assert REF.fullmatch(value) and REF.fullmatch(value)["name"] in SECRETS, f"{name}.{key}={value}"
            for password in re.findall(r"://[^:/@\s]+:([^@\s]*)@", value):
                assert REF.fullmatch(password) and REF.fullmatch(password)["name"] in SECRETS, f"{name}.{key}"
    assert "DFLASH_SGLANG_API_KEY" in environment(services["airflow-gpu-worker"])


def test_compose_refuses_to_start_while_a_secret_is_empty(config, env_example, filled_env):
    assert {name for name in SECRETS if env_example.get(name) == ""} == SECRETS  # placeholders only
    for secret in SECRETS:
        with pytest.raises(ComposeRefused, match=f"set {secret} in .env"):
            config({**filled_env, secret: ""})
    with pytest.raises(ComposeRefused, match="set POSTGRES_PASSWORD in .env"):  # absent is refused as empty is
        config({name: value for name, value in filled_env.items() if name != "POSTGRES_PASSWORD"})


def test_env_file_stays_out_of_git_and_the_image():
    assert ".env" in (ROOT / ".gitignore").read_text().split()
    assert ".env" in (ROOT / ".dockerignore").read_text().split()


def test_every_variable_is_documented_in_env_example_with_the_same_default(env_example):
    refs = list(REF.finditer(COMPOSE.read_text()))
    assert {m["name"] for m in refs} <= set(env_example), "add the missing variables to .env.example"
    for m in refs:
        if m["op"] == ":-":
            assert env_example[m["name"]] == m["arg"], f"{m[0]} vs .env.example {env_example[m['name']]!r}"
    assert not re.search(r"(?<!\$)\$[A-Za-z_]", COMPOSE.read_text()), "use ${VAR} (or $$ for a literal $)"


# ------------------------------------------------------------------------------------------ the image
def lock_pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = re.fullmatch(r"([A-Za-z0-9._-]+)==([A-Za-z0-9.+!-]+)", line).groups()
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_dockerfile_builds_from_the_locked_airflow_release_and_installs_the_lock():
    text = DOCKERFILE.read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, flags=re.M)
    assert froms == ["${AIRFLOW_BASE_IMAGE}"], "one stage, its base a build argument (the rehearsal's stand-in)"
    froms = re.findall(r"^ARG AIRFLOW_BASE_IMAGE=(\S+)", text, flags=re.M)  # the default: what the node builds on
    assert len(froms) == 1
    m = re.fullmatch(r"apache/airflow:(?:slim-)?(\d+\.\d+\.\d+)-python(3\.\d+)", froms[0])
    assert m, f"pin an official release and Python: {froms[0]}"
    assert m[1] == lock_pins(ROOT / "requirements.lock")["apache-airflow"]
    assert re.search(r"pip install --no-cache-dir -r \S*/requirements\.lock -r \S*/requirements-services\.lock", text)
    assert re.search(r"pip install --no-cache-dir --no-deps \S+", text)


def test_services_lock_adds_exact_pins_without_repinning_the_project_lock():
    project = lock_pins(ROOT / "requirements.lock")
    services = lock_pins(ROOT / "deploy" / "requirements-services.lock")
    # the Celery executor is in the project lock (the two-node test runs it), Postgres only in the image's
    assert {"apache-airflow-providers-celery", "celery", "redis"} <= set(project)
    assert "apache-airflow-providers-postgres" in services
    assert set(project) & set(services) == set()


# ------------------------------------------------------------------------------------------ docker compose
def compose_available() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True, check=False).returncode == 0


@pytest.mark.skipif(not compose_available(), reason="`docker compose` (the Compose v2 plugin) is not installed")
def test_docker_compose_config_accepts_the_file_and_refuses_it_without_secrets(tmp_path, filled_env):
    def config(env: dict[str, str]) -> subprocess.CompletedProcess:
        env_file = tmp_path / "env"
        env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
        return subprocess.run(["docker", "compose", "--project-directory", str(ROOT), "--env-file", str(env_file),
                               "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True, check=False)

    done = config(filled_env)
    assert done.returncode == 0, done.stderr
    done = config({**filled_env, "POSTGRES_PASSWORD": ""})
    assert done.returncode != 0 and "POSTGRES_PASSWORD" in done.stderr
