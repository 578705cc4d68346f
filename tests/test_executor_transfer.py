"""The TunedExecutor's accelerator path, tested on CPU (issue 17 items 1 and 4):

- a job's output crosses the worker pipe as names of shared-memory segments (vLLM-Omni's own
  format), never as a pickled tensor, and every segment is unlinked once read or discarded;
- a CFG pair agrees on its cancel step through the executor's shared board, with no host
  synchronization per denoise step: two real processes, a real gloo all-gather per step, vLLM-Omni's
  own CFG-parallel step;
- under sequence parallel, the four processes of a CFG 2 x SP 2 pair, and the two of a unit running a
  job alone, stop at the same step (four real processes, gloo all-to-all and all-gather per step).

The same paths through real servers (a pair video, a pair image, the per-rank peak memory on DP 2)
are in ``tests/test_executor.py`` (they share its servers).
"""

from __future__ import annotations

import multiprocessing
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import process_context

SHM = Path("/dev/shm")


def _segments(out) -> list[str]:
    """The shared-memory segment names a packed output refers to."""
    names: list[str] = []

    def walk(v):
        if isinstance(v, dict):
            if v.get("__tensor_shm__") or v.get("__ndarray_shm__"):
                names.append(v["name"])
            else:
                for x in v.values():
                    walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    for field in ("output", "media", "trajectory_latents", "trajectory_timesteps", "trajectory_log_probs"):
        walk(getattr(out, field, None))
    return names


# --------------------------------------------------------------------------------------------------
# 1. Outputs through shared memory
# --------------------------------------------------------------------------------------------------
def test_job_done_with_a_tensor_or_too_many_bytes_is_refused() -> None:
    from vllm_omni.diffusion.data import DiffusionOutput

    from omni_ext.executor import protocol

    here, there = multiprocessing.Pipe()
    with pytest.raises(protocol.TransferRefused, match="tensor"):
        protocol.send(here, protocol.JobDone("omx-1", 0, DiffusionOutput(output=torch.zeros(2, 3)), True, 1.0))
    big = DiffusionOutput(output=[b"x" * (protocol.MAX_JOB_DONE_BYTES + 1)])
    with pytest.raises(protocol.TransferRefused, match="bytes"):
        protocol.send(here, protocol.JobDone("omx-2", 0, big, True, 1.0))
    assert not there.poll(0.1)  # nothing was sent
    # other messages keep the plain pickler (an RPC may return a tensor)
    protocol.send(here, protocol.RpcResult("rpc-1", 0, True, torch.ones(2)))
    assert torch.equal(protocol.recv(there).result, torch.ones(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_output_round_trip_through_shared_memory_leaves_no_segment(dtype) -> None:
    from vllm_omni.diffusion.data import DiffusionOutput

    from omni_ext.executor import protocol

    small = (torch.rand(1, 3, 5, 8, 8) * 200).to(dtype)  # below vLLM-Omni's 1 MB threshold
    large = (torch.rand(1, 3, 17, 128, 128) * 200).to(dtype)  # above it (uint8: 0.8 MB, still moved)
    frames = np.arange(48, dtype=np.uint8).reshape(4, 4, 3)
    out = DiffusionOutput(output={"video": large, "extra": [small, frames]}, trajectory_latents=small.clone())
    protocol.output_to_shared_memory(out)
    names = _segments(out)
    assert len(names) == 4 and all((SHM / n).exists() for n in names)
    here, there = multiprocessing.Pipe()
    protocol.send(here, protocol.JobDone("omx-1", 1, out, True, 2.0))
    got = protocol.output_from_shared_memory(protocol.recv(there).out)
    assert not any((SHM / n).exists() for n in names)  # read once, unlinked
    assert got.output["video"].dtype == dtype and torch.equal(got.output["video"], large)
    assert torch.equal(got.output["extra"][0], small) and np.array_equal(got.output["extra"][1], frames)
    assert torch.equal(got.trajectory_latents, small)


def test_failed_packing_unlinks_every_segment_it_made(monkeypatch) -> None:
    from vllm_omni.diffusion import ipc
    from vllm_omni.diffusion.data import DiffusionOutput

    from omni_ext.executor import protocol

    made: list[str] = []
    real = ipc._tensor_to_shm

    def tensor_to_shm(tensor, d2h_stream=None, created=None):
        handle = real(tensor, d2h_stream=d2h_stream, created=created)
        made.append(handle["name"])
        return handle

    def ndarray_to_shm(array, created=None):
        raise OSError(28, "No space left on device")  # /dev/shm full, after the tensors went in

    monkeypatch.setattr(ipc, "_tensor_to_shm", tensor_to_shm)
    monkeypatch.setattr(ipc, "_ndarray_to_shm", ndarray_to_shm)
    out = DiffusionOutput(output=[torch.rand(400, 1000), torch.rand(4), np.ones(8)])  # 1.6 MB, small, array
    with pytest.raises(OSError):
        protocol.output_to_shared_memory(out)
    assert len(made) == 2 and not any((SHM / n).exists() for n in made)


def test_executor_reader_frees_the_segments_of_an_output_it_discards() -> None:
    """A cancelled job's output, or one that arrives after the executor dropped the job, is discarded
    by ``RankQueue.on_done``; the reader has already copied it out and unlinked its segments."""
    import threading

    from vllm_omni.diffusion.data import DiffusionOutput

    from omni_ext.executor import protocol
    from tests.helpers import rank_queue, wan_request

    ex = rank_queue(cfg_mode="pair", settle_s=0)
    pipes = [multiprocessing.Pipe() for _ in range(2)]  # (worker end, executor end) per rank

    def reader(rank: int) -> None:  # the TunedExecutor's reader thread: every answer goes to the queue
        while True:
            try:
                ex.answer(rank, protocol.recv(pipes[rank][1]))
            except (EOFError, OSError):
                return

    readers = [threading.Thread(target=reader, args=(r,), daemon=True) for r in range(2)]
    for thread in readers:
        thread.start()
    job = ex.submit("video_a-0000000a", wan_request())
    assert job.ranks == (0, 1)
    ex.abort(["video_a-0000000a"])  # running: cancelled, the output that still comes is discarded
    out = DiffusionOutput(output=torch.rand(1, 3, 5, 8, 8))
    protocol.output_to_shared_memory(out)
    names = _segments(out)
    protocol.send(pipes[0][0], protocol.JobDone(job.job_id, 0, None, False, 1.0))
    protocol.send(pipes[1][0], protocol.JobDone(job.job_id, 1, out, True, 1.0))
    assert job.future.result(timeout=10).aborted
    for (mine, _), reader in zip(pipes, readers):
        mine.close()
        reader.join(10)
    assert names and not any((SHM / n).exists() for n in names)


def test_an_answered_request_carries_the_executors_hops_beside_the_pipelines_stages() -> None:
    """The owner rank's answer, through a real pipe with the worker's clock readings, reaches the
    engine with ``omni_ext.queue``/``to_worker``/``worker``/``from_worker`` added to the stage
    durations the pipeline reported (what ``bench cfg-parallel --single-jobs`` takes apart)."""
    from vllm_omni.diffusion.data import DiffusionOutput

    from omni_ext.executor import protocol
    from omni_ext.executor.ranks import hops
    from tests.helpers import rank_queue, wan_request

    assert hops(10.0, 10.5, 10.75, 11.0, 12.0) == {"omni_ext.queue": 0.5, "omni_ext.to_worker": 0.25,
                                                   "omni_ext.worker": 0.25, "omni_ext.from_worker": 1.0}
    assert hops(10.0, None, 10.75, 11.0, 12.0) == {} and hops(10.0, 10.5, 0.0, 0.0, 12.0) == {}
    ex = rank_queue(cfg_mode="pair", settle_s=0)
    job = ex.submit("video_b-0000000b", wan_request())
    began = time.monotonic()
    out = DiffusionOutput(output=torch.rand(1, 3, 5, 8, 8), stage_durations={"WanPipeline.diffuse": 0.01})
    here, there = multiprocessing.Pipe()
    protocol.output_to_shared_memory(out)
    protocol.send(here, protocol.JobDone(job.job_id, 1, out, True, 0.02, began, began + 0.02))
    ex.answer(1, protocol.recv(there))
    ex.on_done(0, protocol.JobDone(job.job_id, 0, None, False, 0.02, began, began + 0.02))
    stages = job.future.result(timeout=10).stage_durations
    assert stages["WanPipeline.diffuse"] == 0.01 and stages["omni_ext.worker"] == pytest.approx(0.02)
    assert 0.0 <= stages["omni_ext.queue"] < 5 and 0.0 <= stages["omni_ext.to_worker"] < 5
    assert 0.0 <= stages["omni_ext.from_worker"] < 5


# --------------------------------------------------------------------------------------------------
# 4. A CFG pair: no host synchronization per step, and both ranks stop at the same step
# --------------------------------------------------------------------------------------------------
SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


def _pair_rank(rank: int, port: int, board, barrier, plan: list, results) -> None:
    """One CFG rank: for each (seq, steps, lag_s) of ``plan``, a job of ``steps`` denoise steps through
    the tuned mixin and vLLM-Omni's CFG-parallel step (a real gloo all-gather each step); reports
    (seq, the step it stopped at or None, host syncs counted during the job)."""
    import time

    import torch.distributed as dist
    from vllm_omni.diffusion.data import DiffusionRequestAbortedError
    from vllm_omni.diffusion.distributed import cfg_parallel

    from omni_ext.executor.pipelines import _TunedCfgMixin
    from omni_ext.executor.role import ROLE, set_role
    from omni_ext.scheduler.placement import JobMode

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    class Group:  # vLLM-Omni's CFG group's all_gather(separate_tensors=True), on the gloo group
        def all_gather(self, t, separate_tensors=False):
            parts = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(parts, t.contiguous())
            return parts

    from vllm_omni.diffusion.distributed import parallel_state

    cfg_parallel.get_cfg_group = parallel_state.get_cfg_group = lambda: Group()
    cfg_parallel.get_classifier_free_guidance_rank = lambda: rank
    cfg_parallel._get_cfg_world_size_or_one = lambda: 2

    class Tiny(_TunedCfgMixin, cfg_parallel.CFGParallelMixin):
        def predict_noise(self, latents, cond):
            return torch.tanh(latents * cond)

    counts = {"n": 0}
    for name in SYNC_METHODS:
        real = getattr(torch.Tensor, name)

        def counting(self, *a, _real=real, **k):
            counts["n"] += 1
            return _real(self, *a, **k)

        setattr(torch.Tensor, name, counting)

    ROLE.rank, ROLE.cancel_slots = rank, board
    pipe = Tiny()
    for seq, steps, lag_s in plan:
        barrier.wait()
        set_role(JobMode.PAIR, cfg_rank=rank, cfg_size=2, seq=seq)
        latents = torch.linspace(-1, 1, 64).reshape(1, 4, 16)
        counts["n"], stopped = 0, None
        try:
            for _ in range(steps):
                if lag_s and rank == 1:
                    time.sleep(random.uniform(0, lag_s))  # this rank's host runs behind, by a varying lag
                noise = pipe.predict_noise_maybe_with_cfg(
                    True, 4.0, {"latents": latents, "cond": torch.full((1,), 1.0)},
                    {"latents": latents, "cond": torch.full((1,), -0.5)}, cfg_normalize=False,
                )
                latents = latents - 0.05 * noise
        except DiffusionRequestAbortedError:
            stopped = ROLE.step - 1
        results.put((rank, seq, stopped, counts["n"], latents.sum().item()))
    dist.destroy_process_group()


@pytest.mark.parametrize("make", [
    lambda: torch.rand(1, 3, 64, 64),
    lambda: torch.rand(4, 5).to(torch.bfloat16),
    lambda: torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),  # not contiguous
    lambda: torch.tensor(7.5),  # 0-dim
    lambda: torch.zeros(0, 3, dtype=torch.float16),  # empty
    lambda: torch.tensor([True, False]),
    lambda: torch.rand(3, 2, dtype=torch.complex64).conj(),  # no aliasing byte view: torch's own reduction
    lambda: torch.rand(2, 2, requires_grad=True),  # torch's own reduction
], ids=["f32", "bf16", "transposed", "0-dim", "empty", "bool", "conj", "grad"])
def test_a_requests_tensors_cross_the_pipe_as_raw_bytes_and_come_back_equal(make) -> None:
    """A job's request tensors (an edit's reference, image-to-video's conditioning) are pickled as
    their raw bytes (the pickle-5 buffer reduction), not through ``torch.serialization``: the same
    values, dtype and shape on the worker, each a writable tensor of its own."""
    import pickle

    from omni_ext.executor import protocol

    t = make()
    before = t.detach().clone()
    run = protocol.RunJob("j1", {"t": t}, protocol.JobMode.PAIR, 2, 1, (0, 1), 1)
    got = pickle.loads(protocol.encode(run)).req["t"]
    assert got.dtype == t.dtype and got.shape == t.shape and got.requires_grad == t.requires_grad
    assert torch.equal(got.detach().resolve_conj(), t.detach().resolve_conj())
    with torch.no_grad():
        got.zero_()  # writable, and its own memory
    assert torch.equal(t.detach(), before)


def test_a_large_reference_pickles_to_its_bytes_and_little_more() -> None:
    """The 12.6 MB reference of an Edit-Plus request adds its bytes to the message, no
    ``torch.serialization`` archive around them."""
    from omni_ext.executor import protocol

    ref = torch.rand(1, 3, 1, 1024, 1024)
    data = protocol.encode(protocol.RunJob("j1", {"vae_images": ref}, protocol.JobMode.PAIR, 2, 1, (0, 1), 1))
    assert ref.nbytes <= len(data) < ref.nbytes + 2048
    assert b"torch._utils" not in bytes(data[:4096]) and b"_rebuild_tensor" in bytes(data)


def test_a_large_job_is_pickled_once_and_reaches_its_ranks_at_once_in_order(monkeypatch) -> None:
    """A job's RunJob holding a 12.6 MB reference (Edit-Plus) is pickled once for both ranks, the
    first rank's copy is written by a thread while the second is written inline (both pipes are
    drained at the same time), and each rank's later messages still come after it."""
    import pickle
    import threading

    from omni_ext.executor import protocol, tuned
    from omni_ext.executor.tuned import TunedExecutor

    encodes = []
    real = protocol.encode
    monkeypatch.setattr(protocol, "encode", lambda msg: encodes.append(type(msg).__name__) or real(msg))
    ex = object.__new__(TunedExecutor)
    pipes = [multiprocessing.Pipe(duplex=False) for _ in range(2)]  # (reader, writer) per rank
    ex._conns = [w for _, w in pipes]
    ex._send_locks = [threading.Lock() for _ in range(2)]
    ex._last_wire = None
    got: dict[int, list] = {0: [], 1: []}

    def read(rank: int) -> None:
        for _ in range(2):
            got[rank].append(pickle.loads(pipes[rank][0].recv_bytes()))

    readers = [threading.Thread(target=read, args=(r,)) for r in (0, 1)]
    for t in readers:
        t.start()
    req = {"vae_images": torch.ones(1, 3, 1, 1024, 1024)}
    run = protocol.RunJob("j1", req, protocol.JobMode.PAIR, 2, 7, (0, 1), 1)
    for r in run.ranks:  # as RankQueue._start sends it
        ex._post(r, run)
    for r in run.ranks:
        ex._post(r, protocol.ResumeJob("j1"))
    for t in readers:
        t.join(30)
    assert encodes == ["RunJob", "ResumeJob", "ResumeJob"], encodes
    for r in (0, 1):
        first, second = got[r]
        assert first.job_id == "j1" and torch.equal(first.req["vae_images"], req["vae_images"])
        assert isinstance(second, protocol.ResumeJob)
    assert ex._last_wire is None  # the bytes are not kept once the last rank has them
    assert tuned.PARALLEL_SEND_BYTES < 12_582_912


@pytest.mark.spawns
def test_cfg_pair_has_no_per_step_host_sync_and_both_ranks_stop_at_the_same_step() -> None:
    import queue
    import socket
    import time

    from omni_ext.executor.role import new_board

    ctx = process_context()
    board = new_board(ctx, 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # seq, steps, rank 1's lag per step (s). seq 1, 2: no cancel, 8 and 40 steps. 3: cancelled before
    # the first step. 4..9: cancelled at a random moment mid-run, one rank lagging.
    plan = [(1, 8, 0.0), (2, 40, 0.0), (3, 30, 0.0)] + [(seq, 400, 0.004) for seq in range(4, 10)]
    barrier, results = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_pair_rank, args=(r, port, board, barrier, plan, results), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    got: dict[int, dict[int, tuple]] = {}
    rng = random.Random(17)
    try:
        for seq, _steps, _ in plan:
            if seq == 3:
                board[0], board[1] = seq, seq  # the executor cancels before the ranks start
            barrier.wait(timeout=120)
            if seq >= 4:
                time.sleep(rng.uniform(0.0, 0.2))
                board[0] = seq  # the executor writes the pair's two slots one after the other
                time.sleep(rng.uniform(0.0, 0.01))
                board[1] = seq
            for _ in range(2):
                rank, s, stopped, syncs, total = results.get(timeout=120)  # a rank stuck in an all-gather: Empty
                got.setdefault(s, {})[rank] = (stopped, syncs, total)
    except queue.Empty:
        pytest.fail(f"a CFG rank hung (results so far: {got})")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    for seq, ranks in got.items():
        assert ranks[0][0] == ranks[1][0], (seq, ranks)  # the same stop step on both ranks
        assert ranks[0][2] == pytest.approx(ranks[1][2]), (seq, ranks)  # and the same latents
    assert got[1][0][0] is None and got[2][0][0] is None  # not cancelled: ran to the end
    assert got[3][0][0] == 0  # cancelled before the start: no step ran
    assert sum(got[s][0][0] is not None and got[s][0][0] > 0 for s in range(4, 10)) >= 3  # stopped mid-run
    # host synchronizations per job: none, for 8 and for 40 steps alike (the cancel flag that went
    # through the all-gather and was read back with .item() made that one per step and rank)
    for seq in (1, 2):
        assert got[seq][0][1] == got[seq][1][1] == 0, got[seq]


# --------------------------------------------------------------------------------------------------
# 5. Sequence parallel (issue 18 item 1): the processes of a job agree on its stop step
# --------------------------------------------------------------------------------------------------
def _cfg_sp_rank(rank: int, port: int, board, barrier, plan: list, results) -> None:
    """One of 4 processes, CFG 2 x SP 2 in vLLM-Omni's order (SP groups [0,1] [2,3], CFG groups [0,2]
    [1,3]). A "pair" job runs on all four: per step an all-to-all in its SP group (Ulysses' collective)
    and an all-gather in its CFG group, the stop check before each step (as ``_pair_step``). A "single"
    job runs on each unit separately (unit 1 a job of its own, seq + 100): per step the SP all-to-all
    only, the stop check after each step (as the progress bar's ``check_step_cancel``). A "...-pause"
    job is asked to pause instead (step-level preemption): it reports the steps it paused before."""
    import time

    import torch.distributed as dist
    from vllm_omni.diffusion.data import DiffusionRequestAbortedError

    from omni_ext.executor.role import ROLE, aborted, check_step_cancel, set_role, stop_now
    from omni_ext.scheduler.placement import JobMode, Units

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    sp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cfg_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    units = Units(2)
    sp_group, cfg_group = sp_groups[units.unit_of(rank)], cfg_groups[units.sp_rank(rank)]
    ROLE.rank, ROLE.cancel_slots = rank, board
    rng = random.Random(rank)
    for seq, mode, steps, lag_s in plan:
        barrier.wait()
        pair = mode.startswith("pair")
        job_seq = seq if pair or units.unit_of(rank) == 0 else seq + 100
        if pair:
            set_role(JobMode.PAIR, cfg_rank=units.cfg_rank(rank, 2), cfg_size=2, seq=job_seq, ranks=(0, 1, 2, 3),
                     sp_rank=units.sp_rank(rank))
        else:
            set_role(JobMode.SINGLE, cfg_size=2, seq=job_seq, ranks=units.ranks_of(units.unit_of(rank)),
                     sp_rank=units.sp_rank(rank))
        paused: list[int] = []
        ROLE.pause_hook = lambda paused=paused: paused.append(ROLE.step - 1)  # a pause that resumes at once
        x, stopped = torch.arange(4, dtype=torch.float32) + rank, None
        try:
            for _ in range(steps):
                if lag_s and rank in (1, 2):
                    time.sleep(rng.uniform(0, lag_s))  # these hosts run behind, by a varying lag
                if pair and stop_now():
                    raise aborted()
                out = torch.empty_like(x)
                dist.all_to_all_single(out, x, group=sp_group)
                if pair:
                    parts = [torch.empty_like(out) for _ in range(2)]
                    dist.all_gather(parts, out, group=cfg_group)
                    out = parts[0] - parts[1]
                x = torch.tanh(out) + 1.0
                check_step_cancel()  # a no-op for a pair
        except DiffusionRequestAbortedError:
            stopped = ROLE.step - 1
        results.put((rank, job_seq, stopped if not mode.endswith("pause") else tuple(paused)))
    dist.destroy_process_group()


@pytest.mark.spawns
def test_cfg_x_sequence_parallel_processes_stop_at_the_same_step() -> None:
    """A cancelled job stops at the same step on every process that shares its collectives: the four
    of a CFG 2 x SP 2 pair, the two of a unit running a SINGLE job (while the other unit runs another
    job); a process that stopped alone would leave the others waiting in an all-to-all (a hang here).
    A job asked to pause (step-level preemption) pauses the same way: all its processes together."""
    import queue
    import socket
    import time

    from omni_ext.executor.role import PAUSE, new_board, pause_token

    ctx = process_context()
    board = new_board(ctx, 4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # seq, mode, steps, lag per step (s): 1, 2 run to the end; 3-6 are cancelled at a random moment mid-run
    # (3000 steps, ~6 s: a busy host may deschedule this process for a while before it cancels).
    # A "single" seq s is two jobs: s on unit 0, s + 100 on unit 1.
    plan = [(1, "pair", 6, 0.0), (2, "single", 6, 0.0)] + [
        (seq, "pair" if seq % 2 else "single", 3000, 0.004) for seq in (3, 4, 5, 6)] + [
        (7, "pair-pause", 1000, 0.004), (8, "single-pause", 1000, 0.004)]
    barrier, results = ctx.Barrier(5), ctx.Queue()
    procs = [ctx.Process(target=_cfg_sp_rank, args=(r, port, board, barrier, plan, results), daemon=True)
             for r in range(4)]
    for p in procs:
        p.start()
    got: dict[int, dict[int, int | None]] = {}
    rng = random.Random(18)
    try:
        for seq, mode, _, _ in plan:
            barrier.wait(timeout=180)
            if seq >= 3:
                time.sleep(rng.uniform(0.02, 0.2))
                for rank in rng.sample(range(4), 4):  # the executor writes the slots one after the other
                    job_seq = seq if mode.startswith("pair") or rank < 2 else seq + 100
                    if mode.endswith("pause"):
                        board[PAUSE * 4 + rank] = pause_token(job_seq, 1)
                    else:
                        board[rank] = job_seq
                    time.sleep(rng.uniform(0.0, 0.01))
            for _ in range(4):
                rank, s, stopped = results.get(timeout=180)  # a process stuck in a collective: Empty
                got.setdefault(s, {})[rank] = stopped
    except queue.Empty:
        pytest.fail(f"a process hung (results so far: {got})")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert set(got[1]) == {0, 1, 2, 3} and set(got[2]) == {0, 1} and set(got[102]) == {2, 3}
    for seq, stops in got.items():
        assert len(set(stops.values())) == 1, (seq, stops)  # one stop step for all processes of a job
    assert got[1][0] is None and got[2][0] is None and got[102][2] is None  # not cancelled: ran to the end
    cancelled = [got[s][min(got[s])] for s in (3, 4, 104, 5, 6, 106)]
    assert all(t is not None and t < 3000 for t in cancelled), got  # each stopped, before its last step
    # asked to pause: every process of the job paused once, before the same step, and ran to the end
    assert set(got[7]) == {0, 1, 2, 3} and set(got[8]) == {0, 1} and set(got[108]) == {2, 3}
    assert all(len(got[s][min(got[s])]) == 1 for s in (7, 8, 108)), got
