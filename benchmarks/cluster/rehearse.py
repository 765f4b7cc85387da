"""The cluster rehearsal: lit_grpo trained across two trainer "hosts" and two inference "hosts"
(network namespaces, `benchmarks/cluster/netns.py`; root needed) launched as
docs/guides/multi-node.md tells users to, then any process killed and the network cut.

    make rehearse-cluster                                   # everything below, --served included
    python -m benchmarks.cluster.rehearse --short           # what CI runs: DDP across and on one node, one kill, resume
    python -m benchmarks.cluster.rehearse --faults kill-train-1 --repeats 5

Stages:

1. **Across two nodes, DDP and FSDP2.** torchrun on `train-0` and `train-1` (`--nnodes=2
   --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=train-0:29400 --max-restarts=0
   --rdzv-conf=read_timeout=30`), `python -m lit_grpo.train +experiment=arithmetic` (synchronous,
   the `hf` sampler) over gloo, the output folder shared by path (the namespaces share the machine's
   file system as nodes share a network one). Both nodes must end 0, their checkpoints whole.
2. **The same run on one node** (Lightning's launcher, `trainer.devices=2`): its final weights must
   be bit-identical to stage 1's (the same ranks, rows, seeds and gloo sums; only the transport differs).
3. **Served** (`--served`): `python -m lit_grpo.serve` on `infer-0` and `infer-1`, keyed
   (LIT_GRPO_SERVER_KEY), listening on the node's address; both trainer nodes with
   `sampler=vllm_server` and the two URLs (rank r samples from and syncs server r), the weight-sync
   folder shared by path. Reported: the served logprobs' drift against the trainer's after each sync
   (`train/drift/k3`, float32 both sides), the median step and sync, whether the key shows in any
   log. Then a SIGKILL to the server on `infer-1`, and to the EngineCore of the one on `infer-0`
   (each `--repeats` times, after step 4's, 6's, ... checkpoint): the seconds until both trainers
   ended and their messages; the server restarted and the run relaunched with `resume=auto` must end
   0 (vLLM's sampling is not bit-reproducible across a restart, so no weights are compared).
4. **Faults** on stage 1's DDP run, each `--repeats` times at different moments (after step 4's,
   6's, ... checkpoint): a SIGKILL to the trainer worker on node 1 or on node 0, node 1's link down
   for `--link-down-s` seconds. For each: the seconds from the fault until each node's worker and
   torchrun agent ended, each node's exit code and `error:` line, tracebacks of lit_grpo's (and,
   apart, torchrun's own reports), anything left running in the namespaces, the checkpoints whole;
   then the run relaunched on both nodes with `resume=auto` to the end, its final weights compared
   with stage 1's (bit-identical expected).

The outcomes are printed as they come (one JSON line each), and written to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.cluster.netns import Cluster, _namespace_pids, _stop, available

REPO = Path(__file__).resolve().parents[2]
TRAINERS = ("train-0", "train-1")
RDZV_PORT = 29400
CHECKPOINT_EVERY = 2
RDZV_READ_TIMEOUT_S = 30
"""torchrun's agent waits this long for its rendezvous store (60 s by default): an agent cut off from
node 0 gives up after it, instead of when the link comes back."""
RUN = [
    "+experiment=arithmetic",
    "trainer.accelerator=cpu",
    "trainer.devices=1",
    "+trainer.extra.num_nodes=2",
    "offpolicy.synchronous=true",
    f"checkpoint.save_interval={CHECKPOINT_EVERY}",
    "trainer.enable_progress_bar=false",
    "callbacks=none",
]
FAULTS = ("kill-train-1", "kill-train-0", "link-down-train-1")


def torchrun_command(run_dir: Path, hydra_dir: Path, overrides: list[str]) -> list[str]:
    """What a user types on each trainer node (docs/guides/multi-node.md)."""
    return [
        "torchrun",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=train-0:{RDZV_PORT}",
        "--rdzv-id=rehearsal",
        f"--rdzv-conf=read_timeout={RDZV_READ_TIMEOUT_S}",
        "--max-restarts=0",
        "-m",
        "lit_grpo.train",
        *RUN,
        *overrides,
        f"output_dir={run_dir}",
        f"hydra.run.dir={hydra_dir}",
    ]


def node_env() -> dict[str, str]:
    python_dir = Path(sys.executable).parent
    return {
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "PATH": f"{python_dir}{os.pathsep}{os.environ['PATH']}",
    }


@dataclass
class Outcome:
    """One launch on both trainer nodes."""

    fault: str
    moment: str
    codes: dict[str, int] = field(default_factory=dict)
    stop_s: float | None = None
    errors: dict[str, str] = field(default_factory=dict)
    worker_stop_s: dict[str, float] = field(default_factory=dict)
    node_stop_s: dict[str, float] = field(default_factory=dict)
    tracebacks: list[str] = field(default_factory=list)
    agent_tracebacks: list[str] = field(default_factory=list)
    left_running: list[int] = field(default_factory=list)
    checkpoints_whole: bool | None = None
    resumed_bit_identical: bool | None = None
    wall_s: float = 0.0


def start_trainers(cluster: Cluster, run_dir: Path, overrides: list[str], tag: str) -> dict[str, subprocess.Popen]:
    return {
        node: cluster.popen(
            node,
            torchrun_command(run_dir, cluster.log_dir / f"{node}.{tag}.hydra", overrides),
            env=node_env(),
            cwd=REPO,
            label=f"torchrun-{tag}",
        )
        for node in TRAINERS
    }


def checkpoints(run_dir: Path) -> list[Path]:
    root = run_dir / "checkpoints"
    return sorted(p for p in root.glob("step_*") if p.is_dir()) if root.is_dir() else []


def newest_step(run_dir: Path) -> int:
    return max((int(p.name.split("_")[1]) for p in checkpoints(run_dir)), default=0)


def read_outcome(cluster: Cluster, procs: dict[str, subprocess.Popen], outcome: Outcome) -> None:
    for node, proc in procs.items():
        outcome.codes[node] = proc.returncode
        log = cluster.log(proc)
        lines = [line for line in log.splitlines() if line.startswith("error: ")]
        if lines:
            outcome.errors[node] = lines[-1]
        if worker_tracebacks(log):
            outcome.tracebacks.append(node)
        if agent_tracebacks(log):
            outcome.agent_tracebacks.append(node)


def end_stuck(cluster: Cluster, procs: dict[str, subprocess.Popen], outcome: Outcome) -> None:
    """The trainers of a fault that did not stop in time: their Python stacks into the outcome (with
    py-spy, when installed: where a run hung is the finding), then ended, so the relaunch does not
    meet the old agents at the rendezvous."""
    import shutil

    stuck = {node: proc for node, proc in procs.items() if proc.poll() is None}
    if not stuck:
        return
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    for node in stuck:
        pids = [pid for pid in _namespace_pids(cluster.nodes[node].namespace) if b"lit_grpo.train" in _cmdline(pid)]
        if spy is None:
            outcome.errors[f"{node}.stacks"] = "still running (install py-spy for its stacks)"
            continue
        dumps = [
            subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60).stdout
            for pid in pids
        ]
        outcome.errors[f"{node}.stacks"] = "\n".join(dumps)
    _stop(list(stuck.values()), [cluster.nodes[node].namespace for node in stuck], 2.0)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def worker_tracebacks(log: str) -> int:
    """Python tracebacks of lit_grpo's worker in a node's log (a frame in lit_grpo). torchrun's agent
    prints its own when its worker ends non-zero (`ChildFailedError`) or node 0's agent is gone (its
    rendezvous store): torchrun's design, counted apart (`agent_tracebacks`)."""
    blocks = log.split("Traceback (most recent call last):")[1:]
    return sum("/lit_grpo/" in b for b in blocks)


def agent_tracebacks(log: str) -> int:
    blocks = log.split("Traceback (most recent call last):")[1:]
    return sum("/lit_grpo/" not in b for b in blocks)


def all_whole(run_dir: Path) -> bool:
    from lit_grpo.run.checkpoint import verify

    return all(verify(step) is None for step in checkpoints(run_dir))


def final_weights(run_dir: Path):
    from safetensors.torch import load_file

    return load_file(run_dir / "final_model" / "model.safetensors")


def same_weights(a: Path, b: Path) -> bool:
    import torch

    wa, wb = final_weights(a), final_weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def clean_run(cluster: Cluster, run_dir: Path, steps: int, timeout_s: float, strategy: str = "ddp") -> Outcome:
    outcome = Outcome("none", f"{strategy}: no fault")
    start = time.monotonic()
    procs = start_trainers(
        cluster, run_dir, [f"max_steps={steps}", f"trainer.strategy={strategy}"], f"clean-{strategy}"
    )
    cluster.wait(list(procs.values()), timeout_s)
    outcome.wall_s = time.monotonic() - start
    read_outcome(cluster, procs, outcome)
    outcome.checkpoints_whole = all_whole(run_dir)
    return outcome


def one_node_run(run_dir: Path, steps: int, timeout_s: float, strategy: str = "ddp") -> int:
    """The same run as 2 processes on this machine, under Lightning's own launcher."""
    overrides = [o for o in RUN if not o.startswith(("trainer.devices", "+trainer.extra.num_nodes"))]
    cmd = [
        sys.executable,
        "-m",
        "lit_grpo.train",
        *overrides,
        "trainer.devices=2",
        f"trainer.strategy={strategy}",
        f"max_steps={steps}",
        f"output_dir={run_dir}",
        f"hydra.run.dir={run_dir}.hydra",
    ]
    env = {**os.environ, **node_env()}
    return subprocess.run(cmd, cwd=REPO, env=env, timeout=timeout_s, capture_output=True).returncode


def inject(cluster: Cluster, fault: str, procs: dict[str, subprocess.Popen], link_down_s: float) -> None:
    if fault.startswith("kill-"):
        node = fault.removeprefix("kill-")
        worker = worker_pid(procs[node])
        os.kill(worker, 9)
    elif fault.startswith("link-down-"):
        cluster.link_down(fault.removeprefix("link-down-"))  # up again by the driver after link_down_s
    else:
        raise ValueError(fault)


def worker_pid(torchrun: subprocess.Popen) -> int:
    """The lit_grpo worker a node's torchrun agent started (a child of the agent, in a session of its own)."""
    for task in Path(f"/proc/{torchrun.pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"lit_grpo.train" in cmd:
                return int(pid)
    raise RuntimeError(f"no lit_grpo worker under the torchrun agent pid {torchrun.pid}")


def _has_worker(torchrun: subprocess.Popen) -> bool:
    try:
        worker_pid(torchrun)
        return True
    except (RuntimeError, OSError):
        return False


def faulted_run(
    cluster: Cluster,
    run_dir: Path,
    reference: Path,
    fault: str,
    after_checkpoints: int,
    steps: int,
    link_down_s: float,
    timeout_s: float,
) -> Outcome:
    outcome = Outcome(fault, f"after step {CHECKPOINT_EVERY * after_checkpoints}'s checkpoint")
    procs = start_trainers(
        cluster, run_dir, [f"max_steps={steps}", "trainer.strategy=ddp"], f"{fault}-{after_checkpoints}"
    )
    deadline = time.monotonic() + timeout_s
    while newest_step(run_dir) < CHECKPOINT_EVERY * after_checkpoints:
        if any(p.poll() is not None for p in procs.values()) or time.monotonic() > deadline:
            read_outcome(cluster, procs, outcome)
            outcome.errors["driver"] = "the run ended or stalled before the fault"
            return outcome
        time.sleep(0.1)
    faulted = time.monotonic()
    inject(cluster, fault, procs, link_down_s)
    while time.monotonic() - faulted < 180 and any(p.poll() is None for p in procs.values()):
        for node, proc in procs.items():
            if proc.poll() is not None and node not in outcome.node_stop_s:
                outcome.node_stop_s[node] = round(time.monotonic() - faulted, 1)
            worker_gone = node in outcome.worker_stop_s or not _has_worker(proc)
            if worker_gone and node not in outcome.worker_stop_s:
                outcome.worker_stop_s[node] = round(time.monotonic() - faulted, 1)
        time.sleep(0.1)
    outcome.stop_s = time.monotonic() - faulted if all(p.poll() is not None for p in procs.values()) else None
    end_stuck(cluster, procs, outcome)
    read_outcome(cluster, procs, outcome)
    time.sleep(1)
    outcome.left_running = [pid for pid in _namespace_pids_of(cluster) if pid not in (p.pid for p in procs.values())]
    outcome.checkpoints_whole = all_whole(run_dir)
    if fault.startswith("link-down-"):  # the cable back in once the outage is over, before the relaunch
        time.sleep(max(0.0, link_down_s - (time.monotonic() - faulted)))
        cluster.link_up(fault.removeprefix("link-down-"))
    relaunch = [f"max_steps={steps}", "trainer.strategy=ddp", "resume=auto"]
    resumed = start_trainers(cluster, run_dir, relaunch, f"{fault}-{after_checkpoints}-resume")
    cluster.wait(list(resumed.values()), timeout_s)
    if all(p.returncode == 0 for p in resumed.values()):
        outcome.resumed_bit_identical = same_weights(run_dir, reference)
    else:
        outcome.errors["resume"] = f"codes {[p.returncode for p in resumed.values()]}"
    return outcome


def _namespace_pids_of(cluster: Cluster) -> list[int]:
    return [pid for node in cluster.nodes.values() for pid in _namespace_pids(node.namespace)]


SERVERS = ("infer-0", "infer-1")
SERVER_PORT = 8000
SERVER_KEY_ENV = "LIT_GRPO_SERVER_KEY"
SERVED_DRIFT_K3_MAX = 1e-4
"""The served logprobs against the trainer's after each sync (float32 both sides): k3 drift of float rounding."""
SERVED = ["model.num_heads=2"]  # vLLM's CPU attention needs a head size it supports


def base_model_folder(work: Path) -> Path:
    """The demo's policy as built from its seed, saved for the servers' `--model` (the servers load
    it; the trainer builds the same weights from the same config and seed)."""
    from lit_grpo.models.load import load_policy, load_tokenizer, save_pretrained
    from lit_grpo.run.validate import validate
    from lit_grpo.train import compose_config

    c = validate(compose_config([*RUN, *SERVED, f"output_dir={work / 'unused'}"]))
    tokenizer = load_tokenizer(c.model)
    return save_pretrained(load_policy(c.model, tokenizer, c.seed), tokenizer, work / "base_model")


def start_servers(
    cluster: Cluster, folder: Path, key: str, timeout_s: float, only: tuple[str, ...] = SERVERS
) -> dict[str, subprocess.Popen]:
    """`python -m lit_grpo.serve` on each inference node, keyed, on the node's address (as the docs say)."""
    procs = {
        node: cluster.popen(
            node,
            [
                sys.executable, "-m", "lit_grpo.serve", "--model", str(folder),
                "--host", cluster.address(node), "--port", str(SERVER_PORT),
                "--dtype", "float32", "--seed", "0", "--enforce-eager",
                "--kv-cache-memory-bytes", "64M", "--max-model-len", "256",
            ],
            env={**node_env(), SERVER_KEY_ENV: key},
            cwd=REPO,
            label="serve",
        )
        for node in only
    }  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while not all("Application startup complete" in cluster.log(p) for p in procs.values()):
        for node, proc in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"the server on {node} ended (code {proc.returncode}):\n{cluster.log(proc)[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the servers did not come up within {timeout_s:.0f} s")
        time.sleep(1)
    return procs


SERVER_FAULTS = ("kill-server-infer-1", "kill-enginecore-infer-0")


def served_overrides(work: Path, steps: int) -> list[str]:
    urls = ",".join(f"'http://{node}:{SERVER_PORT}'" for node in SERVERS)
    return [
        *SERVED,
        f"max_steps={steps}",
        "trainer.strategy=ddp",
        "sampler=vllm_server",
        f"sampler.server_urls=[{urls}]",
        f"sampler.weight_sync_dir={work / 'weight_sync'}",
        "sampler.max_completion_tokens=8",
        "sampler.request_timeout_s=30",
        "sampler.max_retries=1",
    ]


def start_served_trainers(cluster: Cluster, run_dir: Path, overrides: list[str], key: str, tag: str):
    return {
        node: cluster.popen(
            node,
            torchrun_command(run_dir, cluster.log_dir / f"{node}.{tag}.hydra", overrides),
            env={**node_env(), SERVER_KEY_ENV: key},
            cwd=REPO,
            label=f"torchrun-{tag}",
        )
        for node in TRAINERS
    }


def engine_core_pid(server: subprocess.Popen) -> int:
    """The EngineCore process of a vLLM server (a child of its API process, titled `VLLM::EngineCore`)."""
    for task in Path(f"/proc/{server.pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            if "EngineCore" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                return int(pid)
    raise RuntimeError(f"no EngineCore under the server pid {server.pid}")


def served_run(cluster: Cluster, work: Path, steps: int, timeout_s: float, repeats: int) -> dict:
    """Both trainer nodes sampling from the two keyed servers (rank r from server r), weights synced
    through a folder both sides read by path: what the run logged of the served logprobs' drift
    against the trainer's, its step and sync seconds. Then each of SERVER_FAULTS `repeats` times,
    after step 4's, 6's, ... checkpoint: how long until both trainers stopped, their messages, then the
    server restarted and the run relaunched with resume=auto (it must end 0; vLLM's sampling is
    not bit-reproducible across a restart, so the weights are not compared)."""
    import csv
    import secrets

    key = secrets.token_hex(16)
    folder = base_model_folder(work)
    started = time.monotonic()
    servers = start_servers(cluster, folder, key, timeout_s)
    up_s = time.monotonic() - started
    run_dir = work / "served"
    procs = start_served_trainers(cluster, run_dir, served_overrides(work, steps), key, "served")
    began = time.monotonic()
    cluster.wait(list(procs.values()), timeout_s)
    wall = time.monotonic() - began
    rows = list(csv.DictReader((run_dir / "metrics.csv").open())) if (run_dir / "metrics.csv").is_file() else []
    k3 = [float(r["train/drift/k3"]) for r in rows if r.get("train/drift/k3")]
    sync = [float(r["perf/weight_sync_s"]) for r in rows if r.get("perf/weight_sync_s")]
    step = [float(r["perf/step_s"]) for r in rows if r.get("perf/step_s")]
    codes = {node: proc.returncode for node, proc in procs.items()}
    result: dict = {
        "codes": codes,
        "servers_up_s": up_s,
        "wall_s": wall,
        "steps_logged": len(rows),
        "max_drift_k3": max(k3) if k3 else None,
        "median_weight_sync_s": sorted(sync)[len(sync) // 2] if sync else None,
        "median_step_s": sorted(step)[len(step) // 2] if step else None,
        "errors": {node: cluster.log(p).splitlines()[-1:] for node, p in procs.items() if p.returncode},
        "faults": [],
    }
    for fault, i in [(f, i) for f in SERVER_FAULTS for i in range(repeats)]:
        at = CHECKPOINT_EVERY * (2 + i)
        outcome = Outcome(fault, f"after step {at}'s checkpoint")
        fault_dir = work / f"{fault}-{i}"
        procs = start_served_trainers(cluster, fault_dir, served_overrides(work, 400), key, f"{fault}-{i}")
        while newest_step(fault_dir) < at and all(p.poll() is None for p in procs.values()):
            time.sleep(0.1)
        node = fault.rsplit("-", 2)[-2] + "-" + fault.rsplit("-", 1)[-1]  # infer-0 / infer-1
        victim = servers[node].pid if fault.startswith("kill-server") else engine_core_pid(servers[node])
        faulted = time.monotonic()
        os.kill(victim, 9)
        while time.monotonic() - faulted < 180 and any(p.poll() is None for p in procs.values()):
            for name, proc in procs.items():
                if proc.poll() is not None and name not in outcome.node_stop_s:
                    outcome.node_stop_s[name] = round(time.monotonic() - faulted, 1)
            time.sleep(0.1)
        outcome.stop_s = time.monotonic() - faulted if all(p.poll() is not None for p in procs.values()) else None
        end_stuck(cluster, procs, outcome)
        read_outcome(cluster, procs, outcome)
        outcome.checkpoints_whole = all_whole(fault_dir)
        servers[node].kill()
        servers[node].wait()
        servers.update(start_servers(cluster, folder, key, timeout_s, only=(node,)))
        relaunch = served_overrides(work, newest_step(fault_dir) + 4) + ["resume=auto"]
        resumed = start_served_trainers(cluster, fault_dir, relaunch, key, f"{fault}-{i}-resume")
        cluster.wait(list(resumed.values()), timeout_s)
        outcome.resumed_bit_identical = None
        if any(p.returncode for p in resumed.values()):
            outcome.errors["resume"] = f"codes {[p.returncode for p in resumed.values()]}"
        result["faults"].append(asdict(outcome))
        print(json.dumps(asdict(outcome)), flush=True)
    for proc in servers.values():
        proc.terminate()
    logs = {
        node: "".join(p.read_text(errors="replace") for p in cluster.log_dir.glob(f"{node}.*.log"))
        for node in cluster.nodes
    }
    result["key_in_logs"] = [node for node, text in logs.items() if key in text]
    result["ok"] = (
        set(codes.values()) == {0}
        and not result["key_in_logs"]
        and bool(k3)
        and max(k3) < SERVED_DRIFT_K3_MAX
        and all(
            f["stop_s"] is not None and f["stop_s"] < 60 and not f["tracebacks"] and "resume" not in f["errors"]
            for f in result["faults"]
        )
    )
    return result


def median_metric(run_dir: Path, name: str) -> float:
    import csv
    import statistics

    rows = csv.DictReader((run_dir / "metrics.csv").open())
    return statistics.median(float(r[name]) for r in rows if r.get(name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster.rehearse", description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", type=Path, default=None, help="runs and logs (a temporary folder by default)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--faults", nargs="*", default=list(FAULTS), choices=FAULTS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--link-down-s", type=float, default=90.0)
    parser.add_argument("--short", action="store_true", help="CI: the clean runs and one kill of node 1's trainer")
    parser.add_argument("--out", type=Path, default=None, help="the outcomes as JSON")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--served", action="store_true", help="also: both nodes sampling from keyed vLLM servers on infer-0 and infer-1"
    )
    args = parser.parse_args(argv)
    reason = available()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    import tempfile

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="lit_grpo_rehearsal_"))
    work.mkdir(parents=True, exist_ok=True)
    faults = ["kill-train-1"] if args.short else args.faults
    repeats = 1 if args.short else args.repeats
    outcomes: list[Outcome] = []
    served: dict | None = None
    with Cluster(TRAINERS + SERVERS if args.served else TRAINERS, log_dir=work / "logs") as cluster:
        identical = {}
        for strategy in ("ddp",) if args.short else ("ddp", "fsdp2"):
            across = work / f"clean-{strategy}"
            outcomes.append(clean_run(cluster, across, args.steps, args.timeout_s, strategy))
            one_node = work / f"one-node-{strategy}"
            code = one_node_run(one_node, args.steps, args.timeout_s, strategy)
            ended = outcomes[-1].codes == {n: 0 for n in TRAINERS}
            identical[strategy] = code == 0 and ended and same_weights(across, one_node)
            print(
                f"{strategy} across two nodes: codes {outcomes[-1].codes}, {outcomes[-1].wall_s:.1f} s; the same run "
                f"on one node: code {code}; final weights bit-identical: {identical[strategy]}",
                flush=True,
            )
        reference = work / "clean-ddp"
        step_s = median_metric(reference, "perf/step_s")
        print(f"  its median step: {step_s:.3f} s", flush=True)
        if args.served:
            served = served_run(cluster, work, args.steps, args.timeout_s, 0 if args.short else repeats)
            print("served:", json.dumps(served), flush=True)
        for fault in faults:
            for i in range(repeats):
                outcome = faulted_run(
                    cluster,
                    work / f"{fault}-{i}",
                    reference,
                    fault,
                    2 + i,
                    args.steps,
                    args.link_down_s,
                    args.timeout_s,
                )
                outcomes.append(outcome)
                print(json.dumps(asdict(outcome)), flush=True)
    table = [asdict(o) for o in outcomes]
    if args.out:
        result = {"bit_identical_one_node": identical, "median_step_s": step_s, "served": served, "outcomes": table}
        args.out.write_text(json.dumps(result, indent=1))
    clean = [o for o in outcomes if o.fault == "none"]
    ok = (
        all(identical.values())
        and (served is None or served["ok"])
        and all(
            o.resumed_bit_identical
            and not o.tracebacks
            and not o.left_running
            and o.checkpoints_whole
            and o.stop_s is not None
            and o.stop_s < 60
            and all(c != 0 for c in o.codes.values())
            for o in outcomes
            if o.fault != "none"
        )
        and all(set(o.codes.values()) == {0} for o in clean)
    )
    print("rehearsal:", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
