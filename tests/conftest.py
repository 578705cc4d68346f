"""Shared fixtures: tiny models built once per session, and real ``vllm-omni serve`` processes.

Starting a server costs 20-80 s on a 2-core CPU, so every server configuration the suite needs is
declared once in ``SERVERS`` and all of them are started together (in parallel) the first time any
test asks for one; tests then share them for the whole session.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import pytest

from omni_ext.server_process import ServeProcess
from tests.helpers import (AHEAD_BUILDERS, DRILL_ARGS, DRILL_ENV, START_TIMEOUT_S, build_ahead, own_servers, prestart,
                           stop_prestarted, stop_servers)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TUNED = "omni_ext.executor.TunedExecutor"

#: The keyed servers' keys: tenant A (the key tests/test_api.py and the playground use), tenant B, admin.
TENANT_KEYS = ("sk-omni-ext-test", "sk-omni-ext-other", "sk-omni-ext-admin")

# name -> (tiny model, extra serve args, extra env)
SERVERS: dict[str, tuple[str, list[str], dict[str, str]]] = {
    "wan": ("wan2.1-t2v", [], {"OMNI_EXT_API_MAX_UPLOAD_MB": "2"}),
    "wan-cfg2": ("wan2.1-t2v", ["--cfg-parallel-size", "2"], {}),
    # also: url links behind a proxy on this host (tests/test_links.py: forwarded headers from 127.0.0.1 trusted)
    "qwen": ("qwen-image", [], {"OMNI_EXT_API_TRUSTED_PROXIES": "127.0.0.1,::1"}),
    # also keyed like wan-api, its admin named by the key itself (tests/test_tenants.py: image links per tenant,
    # and signed links that work without a key)
    "qwen-cfg2": ("qwen-image", ["--cfg-parallel-size", "2", "--api-key", *TENANT_KEYS],
                  {"OMNI_EXT_API_ADMIN_KEYS": TENANT_KEYS[2], "OMNI_EXT_API_SIGNED_URL_TTL_S": "600"}),
    # omni-ext's API with --api-key and its own job directory (tests/test_api.py, tests/test_playground.py):
    # three keys, two tenants and an admin named by its hash (tests/test_tenants.py); the TunedExecutor, whose
    # placement journal shows each key its own requests.
    # Served under two names, the second OpenAI's (tests/test_api.py: every served name is accepted in ``model``).
    "wan-api": ("wan2.1-t2v", ["--api-key", *TENANT_KEYS, "--served-model-name", "wan2.1", "sora-2",
                               "--distributed-executor-backend", TUNED, "--additional-config", json.dumps(
        {"omni_ext": {"api": {"admin_keys": ["sha256:" + hashlib.sha256(TENANT_KEYS[2].encode()).hexdigest()]}}})],
        {"OMNI_EXT_API_TTL_S": "3600"}),
    # Wan with omni-ext's request validation and routes switched off: vLLM-Omni's stock behaviour,
    # which the tests of those patches show.
    "wan-stock": (
        "wan2.1-t2v", [],
        {"OMNI_EXT_DISABLE_PATCHES": "validate-diffusion-requests,openai-routes,idle-poll-backoff,gloo-shared-device"},
    ),
    # omni-ext's TunedExecutor (tests/test_executor.py): one CFG group of two workers, and two
    # groups of one worker (data parallel).
    "wan-tuned-cfg2": ("wan2.1-t2v", ["--cfg-parallel-size", "2", "--distributed-executor-backend", TUNED], {}),
    # also: url image links on a configured public address (its own, under another name: still reachable;
    # not the playground's server, whose page would then fetch them cross-origin)
    "qwen-tuned-cfg2": ("qwen-image", ["--cfg-parallel-size", "2", "--distributed-executor-backend", TUNED],
                        {"OMNI_EXT_API_PUBLIC_URL": "http://localhost:{port}/"}),
    "wan-tuned-dp2": (
        "wan2.1-t2v",
        ["--distributed-executor-backend", TUNED, "--additional-config", '{"omni_ext": {"data_parallel_size": 2}}'],
        {},
    ),
    # The request scheduler's admission (tests/test_admission.py): two ranks, a 3 s bound on the
    # predicted wait, and a cost seed that predicts ~1 s for its 128x128x17, 8-step jobs from the start.
    "wan-sched": (
        "wan2.1-t2v",
        ["--cfg-parallel-size", "2", "--distributed-executor-backend", TUNED, "--additional-config",
         '{"omni_ext": {"scheduler": {"max_wait_s": 3, "seconds_per_unit": 0.00016}}}'],
        {},
    ),
    # The failure drills (tests/test_drills.py): client loss, a full or unwritable data directory
    # (tests.helpers.DRILL_ARGS: one TunedExecutor worker, one slot; a second worker would add ~0.6 GB
    # PSS next to all the other servers). Its data directory is a tmpfs (TMPFS_DATA_MB) that the drill
    # fills up. The restart drill restarts a server of its own with the same arguments.
    "wan-drill": ("wan2.1-t2v", DRILL_ARGS, DRILL_ENV),
}
# Servers whose API data directory (OMNI_EXT_API_DATA_DIR) is a tmpfs of this many MiB, so that a
# test can fill it for a real ENOSPC. Mounting needs root with CAP_SYS_ADMIN (this host and CI);
# where it is refused the directory stays a plain one and ServerPool.tmpfs says so.
TMPFS_DATA_MB: dict[str, int] = {"wan-drill": 32}


def mount_tmpfs(path: Path, size_mb: int) -> str | None:
    """Mount a tmpfs of ``size_mb`` MiB on ``path``; None on success, else why it was refused."""
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    try:
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755", "tmpfs", str(path)],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if res.returncode == 0 else (res.stderr.strip() or f"mount exited {res.returncode}")


def _own_servers(item: pytest.Item) -> bool:
    """A test that starts servers of its own (marked ``server`` or ``own_servers``, not using the shared pool)."""
    marked = item.get_closest_marker("server") or item.get_closest_marker("own_servers")
    return marked is not None and "server_pool" not in getattr(item, "fixturenames", ())


def _spawns(item: pytest.Item) -> bool:
    """A test without a server that starts processes of its own (marked ``spawns``): 4-6x slower
    next to the pool's start (12 s -> 80-100 s in CI runs), so it runs before the pool starts."""
    return item.get_closest_marker("spawns") is not None and not _uses_pool(item)


def _uses_pool(item: pytest.Item) -> bool:
    return "server_pool" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order: tests that start servers of their own (presets started for real, the multi-machine
    head with its headless replicas, every test that kills or restarts a server:
    tests.helpers.own_server), then the tests without a server (those that spawn processes of their
    own first), then the shared pool's. The own
    servers run before the pool's dozen are up: the host has 24 GiB, and the pool alone holds
    ~19 GiB once all are loaded (a full run with the multi-machine servers next to the pool was
    stopped by the OOM killer). The pool starts in the background when the tests without a server
    begin (:func:`_start_the_pool_early`): its start (~200 s of both cores) then overlaps them
    (mostly one core) instead of following them."""
    own = [i for i in items if _own_servers(i)]
    spawns = [i for i in items if not _own_servers(i) and _spawns(i)]
    pool = [i for i in items if not _own_servers(i) and _uses_pool(i)]
    rest = [i for i in items if not _own_servers(i) and not _spawns(i) and not _uses_pool(i)]
    items[:] = own + spawns + rest + pool


#: One test run with servers at a time per host: a second run's servers beside a first run's pool
#: (~19 GiB) exhaust the memory and slow both. A run that will start servers holds this lock.
SERVER_LOCK = Path(os.environ.get("OMNI_EXT_SERVER_LOCK", "/tmp/omni-ext-server.lock"))
_LOCK = pytest.StashKey[object]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Wait for, then hold, :data:`SERVER_LOCK` if this run starts servers (held already when the run was
    started under ``flock`` on it: the lock's descriptor is inherited)."""
    if os.environ.get("OMNI_EXT_NO_SERVERS") == "1" or not any(_own_servers(i) or _uses_pool(i) for i in session.items):
        return
    import contextlib
    import fcntl

    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") == str(SERVER_LOCK):
                return
    lock = open(SERVER_LOCK, "a+")  # noqa: SIM115 (held until the run ends)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"\n[servers] another test run holds {SERVER_LOCK}: waiting for it to end", flush=True)
        fcntl.flock(lock, fcntl.LOCK_EX)
    session.config.stash[_LOCK] = lock


@pytest.fixture(autouse=True)
def _start_the_pool_early(request: pytest.FixtureRequest) -> None:
    """At the first test past the own-server ones, start the shared pool's servers (without waiting
    for them) if any test of this session will use it (see :func:`pytest_collection_modifyitems`)."""
    session = request.session
    if getattr(session, "_omni_pool_started", False) or _own_servers(request.node) or _spawns(request.node):
        return
    session._omni_pool_started = True
    if os.environ.get("OMNI_EXT_NO_SERVERS") == "1" or not any(_uses_pool(i) for i in session.items):
        return
    request.getfixturevalue("server_pool").start()


@pytest.fixture(autouse=True)
def _drain_rank_queues():
    """Stop the executor queues a test made without worker processes (tests.helpers.rank_queue)."""
    yield
    from tests.helpers import OPEN_RANK_QUEUES

    while OPEN_RANK_QUEUES:
        OPEN_RANK_QUEUES.pop().drain()


_MODELS = pytest.StashKey[tuple]()  # (tiny models, tmp_path_factory): what a start ahead needs
#: Start the next test's own servers ahead only while this much memory is available (GiB): the two
#: sequence-parallel tests' servers together are 20 processes.
AHEAD_MIN_AVAILABLE_GIB = 9.0


@pytest.fixture(scope="session")
def tiny_models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from omni_ext.models.tiny import MODELS, build_tiny_model

    root = tmp_path_factory.mktemp("models")
    models = {m: build_tiny_model(m, root / m) for m in MODELS}
    request.config.stash[_MODELS] = models, tmp_path_factory
    return models


@pytest.fixture
def own(request: pytest.FixtureRequest, tiny_models: dict[str, Path], tmp_path: Path):
    """The servers the test's ``own_servers(model, specs, deploy=None, ready=True)`` marker declares
    (name -> ServeProcess, :func:`tests.helpers.own_servers`): started ahead while the test before ran,
    when :func:`pytest_runtest_call` could."""
    marker = request.node.get_closest_marker("own_servers")
    model, specs, deploy = _declared(marker, tiny_models)
    with own_servers(model, tmp_path, specs, deploy, ready=marker.kwargs.get("ready", True)) as procs:
        yield procs


def _declared(marker: pytest.Mark, models: dict[str, Path]) -> tuple[Path, dict, dict | None]:
    """An ``own_servers`` marker's (model path, specs, deploy): ``(model, specs, deploy=None)``, or one
    callable of the tiny models that returns them (a preset rendered for a tiny model; mark it with
    ``pytest.mark.own_servers.with_args(callable)``, as pytest takes a lone callable for the test)."""
    if callable(marker.args[0]):
        return marker.args[0](models)
    model, specs = marker.args
    return models[model], specs, marker.kwargs.get("deploy")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """While an own-server test runs, start the servers of the next test if its ``own_servers`` marker
    declares them: the own-server tests keep ~1.3 of the two cores busy (requests on one-thread
    workers, waits for heartbeats and restarts), and a start is ~30-60 s of both cores."""
    _start_next_ahead(item)
    yield


def _start_next_ahead(item: pytest.Item) -> None:
    items = item.session.items
    if os.environ.get("OMNI_EXT_NO_SERVERS") == "1" or _MODELS not in item.config.stash or not _own_servers(item):
        return
    models, tmp_path_factory = item.config.stash[_MODELS]
    index = items.index(item)
    nxt = items[index + 1] if index + 1 < len(items) else None
    marker = nxt.get_closest_marker("own_servers") if nxt is not None else None
    built = [f for f in getattr(nxt, "fixturenames", ()) if f in AHEAD_BUILDERS]
    if marker is None and not built:
        return
    import psutil

    available = psutil.virtual_memory().available / 2**30
    if available < AHEAD_MIN_AVAILABLE_GIB:
        print(f"\n[servers] not starting {items[index + 1].name}'s servers ahead: {available:.1f} GiB available")
        return
    if marker is not None:
        prestart(*_declared(marker, models), workdir=tmp_path_factory.mktemp("ahead"))
    for fixture in built:  # a fixture's servers (tests.helpers.AHEAD_BUILDERS), e.g. the multi-machine ones
        build_ahead(fixture, models, tmp_path_factory.mktemp(f"ahead-{fixture}"))


def pytest_sessionfinish(session: pytest.Session) -> None:
    stop_prestarted()


class ServerPool:
    """Starts all declared servers at once on first use; hands out ready ones by name."""

    def __init__(self, models: dict[str, Path], log_dir: Path) -> None:
        self.models = models
        self.log_dir = log_dir
        self.procs: dict[str, ServeProcess] = {}
        self.errors: dict[str, BaseException] = {}
        self._lock = threading.Lock()
        self._ready: dict[str, threading.Event] = {}
        #: server name -> its tmpfs data directory (TMPFS_DATA_MB), or the reason it could not be mounted
        self.tmpfs: dict[str, Path | str] = {}

    def _start_all(self) -> None:
        # OMNI_EXT_TEST_SERVERS=a,b starts only those up front (a quicker partial run); any other
        # server is then started when a test first asks for it.
        only = [x for x in os.environ.get("OMNI_EXT_TEST_SERVERS", "").split(",") if x]
        for name in only or SERVERS:
            self._start(name)

    def _start(self, name: str) -> None:
        model, args, env = SERVERS[name]
        data_dir = self.log_dir / f"api-{name}"
        if name in TMPFS_DATA_MB:
            refused = mount_tmpfs(data_dir, TMPFS_DATA_MB[name])
            self.tmpfs[name] = data_dir if refused is None else refused
        proc = ServeProcess(
            model=str(self.models[model]),
            args=args,
            env={"VLLM_OMNI_SERVER_STORAGE__PATH": str(self.log_dir / f"storage-{name}"),
                 "OMNI_EXT_API_DATA_DIR": str(data_dir), **env},
            log_path=self.log_dir / f"{name}.log",
        )
        self.procs[name] = proc.start()
        self._ready[name] = threading.Event()
        threading.Thread(target=self._wait, args=(name,), daemon=True).start()

    def _wait(self, name: str) -> None:
        try:
            self.procs[name].wait_ready(START_TIMEOUT_S)
        except BaseException as exc:  # reported to the test that asks for this server
            self.errors[name] = exc
        finally:
            self._ready[name].set()

    def start(self) -> None:
        """Start every declared server (once), without waiting for any."""
        with self._lock:
            if not self.procs:
                self._start_all()

    def get(self, name: str, *, quiet: bool = False) -> ServeProcess:
        """The ready server ``name``. ``quiet=True`` also waits until every other server started so far
        is up: a test that watches timing (progress that moves, idle CPU, a cancel deadline) must not
        share two cores with several servers still loading (CI saw a 200-step job finish before its
        first poll while the others started)."""
        self.start()
        with self._lock:
            if name not in self.procs:
                self._start(name)
        for other in [name, *(list(self._ready) if quiet else [])]:
            self._ready[other].wait()
        if name in self.errors:
            pytest.fail(f"server {name!r} did not start: {self.errors[name]}")
        return self.procs[name]

    def stop(self) -> None:
        """Stops every server at once: each takes 3-4 s to shut down (mostly waiting on its workers), so
        one after another the dozen of them held the end of a run for ~26 s."""
        import subprocess

        stop_servers(self.procs.values())
        for mounted in self.tmpfs.values():
            if isinstance(mounted, Path):
                subprocess.run(["umount", "-l", str(mounted)], capture_output=True, timeout=30)


@pytest.fixture(scope="session")
def server_pool(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    if os.environ.get("OMNI_EXT_NO_SERVERS") == "1":  # a quick run of the pure tests while servers run elsewhere
        pytest.skip("OMNI_EXT_NO_SERVERS=1: tests that need a shared vllm-omni server are skipped")
    pool = ServerPool(tiny_models, tmp_path_factory.mktemp("servers"))
    yield pool
    pool.stop()
    for name, proc in pool.procs.items():
        if proc.ready_after_s is not None:
            print(f"\n[servers] {name}: ready after {proc.ready_after_s:.1f} s ({proc.log_path})")


@pytest.fixture
def server(server_pool: ServerPool, request: pytest.FixtureRequest) -> ServeProcess:
    """Use with ``@pytest.mark.parametrize("server", ["wan"], indirect=True)``."""
    return server_pool.get(request.param)
