"""Commit and restore benchmark of the changelog-delta backend on a ``file://`` blob store.

Run from the repository root::

    python bench/commit.py                                   # 1M keys, 10k and 50k updates per commit, 20 commits
    python bench/commit.py --keys 1000000,10000000           # both sizes in one run, prints the 10M/1M sync ratio

What it does, per state size N (keys spread over 4 tasks by ``key index % 4``, one store ``counts`` per task):

1. **Load** (not counted): each task bulk-loads its N/4 keys with ``LocalStore.put_all`` (keys in order, values
   16-32 bytes) and makes one durable commit, so the state is in the blob store as the first delta. The background
   snapshot this may trigger is waited for before anything is measured.
2. **Commits**: for each updates-per-commit setting U, ``--commits`` rounds. In a round, U DISTINCT keys drawn at
   random from the whole key space are updated with fresh values (16-32 bytes, hex of random bytes so they compress
   about 2:1), each key in the task that owns it; then the 4 task threads commit together (a barrier releases them,
   as when a job's tasks share a commit interval) on the process's shared commit pool, each waiting for its own
   commit to be durable before the next round. Per task commit: the sync part (``task.commit()`` returning: flush +
   snapshot) and the durable time (until ``PendingCommit.result()`` returns), both measured from the call; the
   delta bytes uploaded (``changelog.delta.bytes``); and, for reference, the zstd-3 size of the same change encoded
   plainly (length-prefixed key and value, sorted). Background snapshots (every 20 commits by default) run as they
   would in a job; their bytes are reported apart. Before each setting the maintenance thread is drained.
3. **Restore**: the tasks are closed; then ``TaskStorage.open`` is timed per task with the local dir kept (reuse),
   after wiping the local dir (full restore from the blob store), and, wiped again, with the 4 tasks opening in
   parallel threads. Each restore is checked: key count and the values of the last round's keys.

With ``--api`` it instead compares the per-key and the vectorized state API on one task's share of the state
(N/4 keys, string keys and integer values, as the Spark count keeps them), in one run, alternating round by round
between two tasks of equal state: each round reads and increments U/4 distinct random keys, either key by key
(``get`` + ``put``) or in one call each (``get_many`` + ``put_many``), then commits durably. Per round: the processing
time (and updates per second), the sync part and the durable time of the commit::

    python bench/commit.py --api --keys 1000000 --updates 10000,50000 --commits 20

Nothing here is a test: the numbers depend on the machine and its load (recorded in the result file).
"""

from __future__ import annotations

if __package__ in (None, ""):  # run as a script: make the repository root importable
    import sys as _sys
    from pathlib import Path as _Path

    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import argparse
import itertools
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import zstandard
from statebackend.backends.changelog.backup import maintenance_pool

from bench.common import format_table, machine_info, p50_p95, write_result
from statebackend.metrics import Metrics
from statebackend.task import TaskStorage

TASKS = 4
STORE = "counts"
JOB = "bench"


@attrs.frozen
class CommitSample:
    """One task's commit."""

    task: int
    round: int
    records: int
    raw_change_bytes: int
    compressed_change_bytes: int
    sync_ms: float
    durable_ms: float
    delta_bytes: int


def key_of(index: int) -> bytes:
    return b"key:%012d" % index


def fresh_value(rng: random.Random) -> bytes:
    """16-32 bytes: hex of 8-16 random bytes (compresses about 2:1, like ids or encoded numbers)."""
    return rng.randbytes(rng.randint(8, 16)).hex().encode()


def reference_compressed_size(records: Sequence[tuple[bytes, bytes]], compressor: zstandard.ZstdCompressor) -> int:
    """The change encoded plainly (2-byte lengths, key, value; sorted) and zstd-compressed at the backend's level."""
    body = b"".join(len(k).to_bytes(2, "big") + k + len(v).to_bytes(2, "big") + v for k, v in records)
    return len(compressor.compress(body))


def drain_maintenance() -> float:
    """Wait for the background snapshots already queued (one maintenance thread, FIFO); returns the wait in ms."""
    started = time.perf_counter()
    maintenance_pool().submit(lambda: None).result()
    return (time.perf_counter() - started) * 1000.0


def make_config(workdir: Path) -> dict[str, Any]:
    blobs = workdir / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    return {
        "job.name": JOB,
        "state.local.dir": str(workdir / "local"),
        "blob.store.url": f"file://{blobs}",
        f"stores.{STORE}.backup.factories": "changelog",
    }


def open_tasks(config: dict[str, Any]) -> list[TaskStorage]:
    return [TaskStorage.open(config, f"task-{t}", metrics=Metrics()) for t in range(TASKS)]


def load(tasks: list[TaskStorage], keys: int) -> dict[str, float]:
    """Bulk-load keys ``t, t+4, ...`` into task ``t`` and commit durably; returns timings in seconds."""
    rng = random.Random(1)
    pool = [fresh_value(rng) for _ in range(1 << 16)]  # load values need not be unique; generating 10M is slow
    started = time.perf_counter()
    put_s = 0.0
    for t, task in enumerate(tasks):
        put_started = time.perf_counter()
        task.store(STORE, typed=False).put_all((key_of(i), pool[i & 0xFFFF]) for i in range(t, keys, TASKS))
        put_s += time.perf_counter() - put_started
        task.commit_durably({"input": "load"})
    commit_s = time.perf_counter() - started - put_s
    snapshot_wait_s = drain_maintenance() / 1000.0
    return {
        "put_s": put_s,
        "commit_s": commit_s,
        "background_snapshot_wait_s": snapshot_wait_s,
        "total_s": time.perf_counter() - started,
    }


def plan_rounds(keys: int, updates: int, commits: int, seed: int) -> list[list[list[tuple[bytes, bytes]]]]:
    """rounds[r][t]: the sorted (key, value) updates of task ``t`` in round ``r`` (``updates`` distinct keys)."""
    rng = random.Random(seed)
    rounds = []
    for _ in range(commits):
        per_task: list[list[tuple[bytes, bytes]]] = [[] for _ in range(TASKS)]
        for index in sorted(rng.sample(range(keys), updates)):
            per_task[index % TASKS].append((key_of(index), fresh_value(rng)))
        rounds.append(per_task)
    return rounds


def run_commits(
    tasks: list[TaskStorage], rounds: list[list[list[tuple[bytes, bytes]]]], offset_base: int
) -> list[CommitSample]:
    """One thread per task; a barrier starts each round's commits together."""
    barrier = threading.Barrier(len(tasks))
    samples: list[CommitSample] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def task_thread(t: int) -> None:
        task = tasks[t]
        store = task.store(STORE, typed=False)
        delta_samples = "changelog.delta.bytes"
        compressor = zstandard.ZstdCompressor(level=3)  # one per thread: a compressor is not thread-safe
        try:
            for r, per_task in enumerate(rounds):
                updates = per_task[t]
                store.put_all(updates)  # processing: not timed
                reference = reference_compressed_size(updates, compressor)
                before = len(task.metrics.samples(delta_samples))
                barrier.wait()
                started = time.perf_counter()
                pending = task.commit({"input": str(offset_base + r)})
                synced = time.perf_counter()
                if pending is None:
                    raise RuntimeError("commit skipped although the previous one was durable")
                pending.result()
                durable = time.perf_counter()
                uploaded = task.metrics.samples(delta_samples)[before:]
                with lock:
                    samples.append(
                        CommitSample(
                            task=t,
                            round=r,
                            records=len(updates),
                            raw_change_bytes=sum(len(k) + len(v) for k, v in updates),
                            compressed_change_bytes=reference,
                            sync_ms=(synced - started) * 1000.0,
                            durable_ms=(durable - started) * 1000.0,
                            delta_bytes=int(sum(uploaded)),
                        )
                    )
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=task_thread, args=(t,), name=f"bench-task-{t}") for t in range(len(tasks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return samples


def summarize_commits(updates: int, samples: list[CommitSample], snapshot_bytes: int, snapshots: int) -> dict[str, Any]:
    sync_p50, sync_p95 = p50_p95([s.sync_ms for s in samples])
    durable_p50, durable_p95 = p50_p95([s.durable_ms for s in samples])
    rounds = sorted({s.round for s in samples})
    per_round_delta = [sum(s.delta_bytes for s in samples if s.round == r) for r in rounds]
    per_round_ref = [sum(s.compressed_change_bytes for s in samples if s.round == r) for r in rounds]
    per_round_raw = [sum(s.raw_change_bytes for s in samples if s.round == r) for r in rounds]
    return {
        "updates_per_commit": updates,
        "task_commits": len(samples),
        "sync_ms_p50": sync_p50,
        "sync_ms_p95": sync_p95,
        "durable_ms_p50": durable_p50,
        "durable_ms_p95": durable_p95,
        "delta_bytes_per_commit_mean": sum(per_round_delta) / len(rounds),
        "compressed_change_bytes_per_commit_mean": sum(per_round_ref) / len(rounds),
        "raw_change_bytes_per_commit_mean": sum(per_round_raw) / len(rounds),
        "delta_over_compressed_change": sum(per_round_delta) / max(1, sum(per_round_ref)),
        "background_snapshots": snapshots,
        "background_snapshot_bytes": snapshot_bytes,
        "samples": [attrs.asdict(s) for s in samples],
    }


def restore_phase(config: dict[str, Any], workdir: Path, keys: int, expected: dict[bytes, bytes]) -> dict[str, Any]:
    """Time TaskStorage.open per task: local dir kept, local dir wiped (sequential), wiped (4 threads)."""
    per_task_keys = [len(range(t, keys, TASKS)) for t in range(TASKS)]

    def check(t: int, task: TaskStorage) -> None:
        store = task.store(STORE, typed=False)
        if store.count() != per_task_keys[t]:
            raise AssertionError(f"task-{t}: restored {store.count()} keys, expected {per_task_keys[t]}")
        for key, value in expected.items():
            if int(key[4:]) % TASKS == t and store.get(key) != value:
                raise AssertionError(f"task-{t}: key {key!r} restored as {store.get(key)!r}, expected {value!r}")

    def timed_open(t: int) -> dict[str, Any]:
        metrics = Metrics()
        started = time.perf_counter()
        task = TaskStorage.open(config, f"task-{t}", metrics=metrics)
        elapsed = (time.perf_counter() - started) * 1000.0
        try:
            check(t, task)
        finally:
            task.close()
        return {
            "task": t,
            "open_ms": elapsed,
            "restore_ms": metrics.samples("restore.ms")[0],
            "bytes_downloaded": int(metrics.counter("restore.bytes")),
            "deltas_replayed": int(metrics.counter("restore.deltas.replayed")),
            "full": int(metrics.counter("restore.stores.full")),
            "reused": int(metrics.counter("restore.stores.reused")),
        }

    local = workdir / "local"
    reuse = [timed_open(t) for t in range(TASKS)]
    shutil.rmtree(local)
    wiped = [timed_open(t) for t in range(TASKS)]
    shutil.rmtree(local)
    parallel: list[dict[str, Any]] = [{}] * TASKS

    def parallel_open(t: int) -> None:
        parallel[t] = timed_open(t)

    started = time.perf_counter()
    threads = [threading.Thread(target=parallel_open, args=(t,)) for t in range(TASKS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    parallel_wall_ms = (time.perf_counter() - started) * 1000.0
    if any(not p for p in parallel):
        raise RuntimeError("a parallel restore failed (see the thread's traceback above)")
    return {
        "reuse": reuse,
        "reuse_total_ms": sum(r["open_ms"] for r in reuse),
        "wiped": wiped,
        "wiped_total_ms": sum(r["open_ms"] for r in wiped),
        "wiped_parallel": parallel,
        "wiped_parallel_wall_ms": parallel_wall_ms,
    }


def run_size(keys: int, updates_settings: list[int], commits: int, workdir_root: Path, keep: bool) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-commit-{keys}-", dir=workdir_root))
    config = make_config(workdir)
    print(f"\n== {keys:,} keys in {TASKS} tasks (work dir {workdir})", flush=True)
    try:
        tasks = open_tasks(config)
        try:
            loading = load(tasks, keys)
            print(
                f"load: put_all {loading['put_s']:.1f} s, first commit {loading['commit_s']:.1f} s, "
                f"background snapshot wait {loading['background_snapshot_wait_s']:.1f} s",
                flush=True,
            )
            phases = []
            offset = 0
            last_round: dict[bytes, bytes] = {}
            for setting_no, updates in enumerate(updates_settings):
                rounds = plan_rounds(keys, updates, commits, seed=1000 * setting_no + 7)
                drain_maintenance()
                snaps_before, snap_bytes_before = snapshot_stats(tasks)
                samples = run_commits(tasks, rounds, offset)
                offset += commits
                drain_maintenance()  # a snapshot started by this setting's commits belongs to it
                snaps_after, snap_bytes_after = snapshot_stats(tasks)
                snaps, snap_bytes = snaps_after - snaps_before, snap_bytes_after - snap_bytes_before
                phase = summarize_commits(updates, samples, int(snap_bytes), snaps)
                phases.append(phase)
                print(
                    f"updates {updates:,}: sync p50 {phase['sync_ms_p50']:.1f} ms p95 {phase['sync_ms_p95']:.1f} "
                    f"ms; durable p50 {phase['durable_ms_p50']:.1f} ms p95 {phase['durable_ms_p95']:.1f} ms",
                    flush=True,
                )
                last_round = {k: v for per_task in rounds[-1] for k, v in per_task}
            # later rounds overwrite earlier ones, and the last setting's last round is the newest of all
        finally:
            for task in tasks:
                task.close()
        drain_maintenance()
        restore = restore_phase(config, workdir, keys, last_round)
        print(
            f"restore: reuse {restore['reuse_total_ms']:.0f} ms, wiped {restore['wiped_total_ms']:.0f} ms "
            f"(4 tasks one after another), wiped in 4 threads {restore['wiped_parallel_wall_ms']:.0f} ms",
            flush=True,
        )
        disk = {"local_bytes": _du(workdir / "local"), "blob_bytes": _du(workdir / "blobs")}
        return {
            "keys": keys,
            "tasks": TASKS,
            "commits_per_setting": commits,
            "load": loading,
            "phases": phases,
            "restore": restore,
            "disk": disk,
            "workdir": str(workdir),
        }
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


def snapshot_stats(tasks: list[TaskStorage]) -> tuple[int, int]:
    """Background snapshots uploaded so far by the tasks, and their bytes."""
    sizes = [size for task in tasks for size in task.metrics.samples("changelog.snapshot.bytes")]
    return len(sizes), int(sum(sizes))


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def print_report(result: dict[str, Any]) -> None:
    rows = []
    for size in result["sizes"]:
        for phase in size["phases"]:
            rows.append(
                [
                    size["keys"],
                    phase["updates_per_commit"],
                    phase["sync_ms_p50"],
                    phase["sync_ms_p95"],
                    phase["durable_ms_p50"],
                    phase["durable_ms_p95"],
                    int(phase["delta_bytes_per_commit_mean"]),
                    int(phase["compressed_change_bytes_per_commit_mean"]),
                    f"{phase['delta_over_compressed_change']:.3f}",
                    phase["background_snapshots"],
                ]
            )
    print()
    print(
        format_table(
            [
                "keys",
                "updates/commit",
                "sync p50 ms",
                "sync p95 ms",
                "durable p50 ms",
                "durable p95 ms",
                "delta bytes/commit",
                "zstd(change) bytes",
                "delta/zstd",
                "bg snapshots",
            ],
            rows,
        )
    )
    rows = []
    for size in result["sizes"]:
        r = size["restore"]
        rows.append(
            [
                size["keys"],
                r["reuse_total_ms"],
                r["wiped_total_ms"],
                " / ".join(f"{x['open_ms']:.0f}" for x in r["wiped"]),
                r["wiped_parallel_wall_ms"],
                sum(x["bytes_downloaded"] for x in r["wiped"]),
                sum(x["deltas_replayed"] for x in r["wiped"]),
            ]
        )
    print()
    print(
        format_table(
            [
                "keys",
                "restore reuse ms (4 tasks)",
                "restore wiped ms (4 tasks)",
                "per task ms",
                "wiped, 4 threads ms",
                "bytes downloaded",
                "deltas replayed",
            ],
            rows,
        )
    )
    for ratio in result.get("sync_p50_ratios", []):
        print(
            f"\nsync p50 {ratio['large_keys']:,} / {ratio['small_keys']:,} keys at {ratio['updates']:,} "
            f"updates/commit: {ratio['ratio']:.2f}"
        )


def run_api_comparison(keys: int, updates_settings: list[int], commits: int, workdir_root: Path) -> dict[str, Any]:
    """Per-key vs vectorized read-modify-write on one task's share of ``keys``; see the module docstring."""
    workdir = Path(tempfile.mkdtemp(prefix="bench-api-", dir=workdir_root))
    config = make_config(workdir)
    config.update({f"stores.{STORE}.key.serde": "string", f"stores.{STORE}.msg.serde": "integer"})
    share = keys // TASKS
    names = [f"k{i:08d}" for i in range(share)]
    tasks = {api: TaskStorage.open(config, f"task-{api}", metrics=Metrics()) for api in ("per-key", "vectorized")}
    try:
        for task in tasks.values():
            task.store(STORE).put_many(names, [1] * share)
            task.commit_durably({"input": "load"})
        drain_maintenance()
        rng = random.Random(5)
        phases = []
        offset = 0
        for updates in updates_settings:
            per_task = updates // TASKS
            rows: dict[str, list[tuple[float, float, float]]] = {api: [] for api in tasks}
            for r in range(commits):
                chosen = [names[i] for i in rng.sample(range(share), per_task)]
                for api, task in tasks.items():
                    store = task.store(STORE)
                    started = time.perf_counter()
                    if api == "per-key":
                        for key in chosen:
                            store.put(key, (store.get(key) or 0) + 1)
                    else:
                        store.put_many(chosen, [(v or 0) + 1 for v in store.get_many(chosen)])
                    processed = time.perf_counter()
                    pending = task.commit({"input": str(offset + r)})
                    synced = time.perf_counter()
                    if pending is None:
                        raise RuntimeError("commit skipped although the previous one was durable")
                    pending.result()
                    durable = time.perf_counter()
                    rows[api].append(
                        ((processed - started) * 1000.0, (synced - processed) * 1000.0, (durable - processed) * 1000.0)
                    )
            offset += commits
            for api, samples in rows.items():
                process_p50, process_p95 = p50_p95([x[0] for x in samples])
                sync_p50, sync_p95 = p50_p95([x[1] for x in samples])
                durable_p50, durable_p95 = p50_p95([x[2] for x in samples])
                phases.append(
                    {
                        "updates_per_commit": updates,
                        "updates_per_task": per_task,
                        "api": api,
                        "process_ms_p50": process_p50,
                        "process_ms_p95": process_p95,
                        "updates_per_s": per_task / (process_p50 / 1000.0),
                        "sync_ms_p50": sync_p50,
                        "sync_ms_p95": sync_p95,
                        "durable_ms_p50": durable_p50,
                        "durable_ms_p95": durable_p95,
                    }
                )
        # both tasks applied the same increments: their states must be equal
        states = [dict(task.store(STORE).items()) for task in tasks.values()]
        if states[0] != states[1] or sum(states[0].values()) != share + commits * sum(
            u // TASKS for u in updates_settings
        ):
            raise AssertionError("the per-key and the vectorized task ended in different states")
    finally:
        for task in tasks.values():
            task.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return {"keys": keys, "keys_per_task": share, "phases": phases}


def print_api_report(result: dict[str, Any]) -> None:
    rows = []
    for phase in result["phases"]:
        rows.append(
            [
                phase["updates_per_task"],
                phase["api"],
                phase["process_ms_p50"],
                phase["process_ms_p95"],
                int(phase["updates_per_s"]),
                phase["sync_ms_p50"],
                phase["sync_ms_p95"],
                phase["durable_ms_p50"],
                phase["durable_ms_p95"],
            ]
        )
    print()
    print(
        format_table(
            [
                "updates/task",
                "API",
                "process p50 ms",
                "process p95 ms",
                "updates/s (p50)",
                "sync p50 ms",
                "sync p95 ms",
                "durable p50 ms",
                "durable p95 ms",
            ],
            rows,
        )
    )
    by = {(p["updates_per_task"], p["api"]): p for p in result["phases"]}
    for (per_task, api), phase in by.items():
        if api == "vectorized":
            base = by[(per_task, "per-key")]
            process = phase["process_ms_p50"] / base["process_ms_p50"]
            sync = phase["sync_ms_p50"] / base["sync_ms_p50"]
            print(f"{per_task} updates/task: vectorized processing {process:.2f}x of per-key, sync part {sync:.2f}x")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", default="1000000", help="total keys, comma-separated for several sizes")
    parser.add_argument("--updates", default="10000,50000", help="distinct keys updated per commit, comma-separated")
    parser.add_argument("--commits", type=int, default=20, help="commits per updates setting")
    parser.add_argument("--workdir", default=tempfile.gettempdir(), help="where the temp dirs go")
    parser.add_argument("--keep", action="store_true", help="keep the local and blob dirs")
    parser.add_argument("--api", action="store_true", help="compare the per-key and the vectorized API instead")
    args = parser.parse_args(argv)
    sizes = [int(k) for k in args.keys.split(",")]
    updates = [int(u) for u in args.updates.split(",")]
    if any(u > k for u in updates for k in sizes):
        parser.error("an updates setting is larger than a key count")

    machine = machine_info()
    print(
        f"machine: {machine['cpus']} CPUs, {machine['memory_gib']} GiB, load {machine['load_average']}, "
        f"Python {machine['python']}"
    )
    if args.api:
        api_result: dict[str, Any] = {
            "benchmark": "commit-api",
            "command": " ".join(["python", "bench/commit.py", *(argv if argv is not None else sys.argv[1:])]),
            "machine": machine,
            "sizes": [run_api_comparison(k, updates, args.commits, Path(args.workdir)) for k in sizes],
        }
        for size in api_result["sizes"]:
            print(f"\n{size['keys']:,} keys ({size['keys_per_task']:,} per task)")
            print_api_report(size)
        print(f"\nresult: {write_result('commit-api', api_result)}")
        return 0
    result: dict[str, Any] = {
        "benchmark": "commit",
        "command": " ".join(["python", "bench/commit.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine,
        "sizes": [run_size(k, updates, args.commits, Path(args.workdir), args.keep) for k in sizes],
    }
    result["load_average_after"] = machine_info()["load_average"]
    ratios = []
    for small, large in itertools.pairwise(result["sizes"]):
        for ps, pl in zip(small["phases"], large["phases"], strict=True):
            ratios.append(
                {
                    "small_keys": small["keys"],
                    "large_keys": large["keys"],
                    "updates": ps["updates_per_commit"],
                    "ratio": pl["sync_ms_p50"] / ps["sync_ms_p50"],
                }
            )
    result["sync_p50_ratios"] = ratios
    print_report(result)
    path = write_result("commit", result)
    print(f"\nresult: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
