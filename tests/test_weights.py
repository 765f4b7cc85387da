"""`full_named_tensors`: the policy's full weights, the same on every rank, however it is sharded.

The sharded cases run for real on 2 CPU processes over gloo (FSDP2 `fully_shard`, hand-made
DTensors, FSDP1, DDP), each with a 60 s collective timeout and a hard deadline on the processes.
The Lightning cases run this file as a script in a subprocess (Lightning relaunches the script
for rank 1): `python tests/test_weights.py {model_parallel,fsdp1} OUT_DIR`.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor import DTensor

from lit_grpo.config import ModelConfig
from lit_grpo.models.load import build_char_tokenizer, build_tiny_model
from lit_grpo.models.weights import full_named_tensors
from lit_grpo.samplers.hf import HFSampler

REPO = Path(__file__).resolve().parents[1]
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


def tiny(seed: int = 0):
    tok = build_char_tokenizer("printable")
    return build_tiny_model(ModelConfig(), len(tok), seed=seed, tokenizer=tok), tok


class PolicyAndReference(nn.Module):
    """What Lightning's FSDPStrategy and DDP wrap: the whole module, the frozen reference inside."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.policy = policy
        self.reference = copy.deepcopy(policy).requires_grad_(False)


# --- one process ------------------------------------------------------------------------------


def test_plain_module_gives_its_own_tensors_in_state_dict_order(tiny_model):
    state = tiny_model.state_dict()
    named = list(full_named_tensors(tiny_model))
    assert [n for n, _ in named] == list(state)
    for name, tensor in named:
        assert tensor.data_ptr() == state[name].data_ptr(), f"{name} was copied"
    names = dict(named)
    # Tied weights under both names, one storage (engines look up their own name).
    assert names["lm_head.weight"].data_ptr() == names["model.embed_tokens.weight"].data_ptr()


def test_prefix_selects_the_policy_of_a_wrapper_and_strips_it(tiny_model):
    wrapper = PolicyAndReference(tiny_model)
    named = list(full_named_tensors(wrapper, prefix="policy."))
    assert [n for n, _ in named] == list(tiny_model.state_dict())
    assert all(t.data_ptr() == p.data_ptr() for (_, t), p in zip(named, tiny_model.state_dict().values()))


def test_hf_sampler_takes_the_gathered_tensors(tiny_model, tokenizer):
    sampler = HFSampler(tiny(seed=1)[0], tokenizer)
    try:
        sampler.update_weights(full_named_tensors(PolicyAndReference(tiny_model), prefix="policy."))
        assert_same_state(sampler.model.state_dict(), tiny_model.state_dict())
    finally:
        sampler.close()


def assert_same_state(got: dict, expected: dict) -> None:
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert got[name].shape == tensor.shape and torch.equal(got[name], tensor), name


# --- two processes, gloo ----------------------------------------------------------------------


def spawn2(fn, tmp_path: Path, *args, timeout_s: float = 120.0) -> None:
    """Run `fn(rank, store_file, *args)` on 2 processes; fail (killing them) past `timeout_s`."""
    ctx = mp.start_processes(fn, args=(str(tmp_path / "store"), *args), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"{fn.__name__} did not finish in {timeout_s} s")


def init_gloo(rank: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=COLLECTIVE_TIMEOUT)


def shard(policy: nn.Module, layout: str) -> tuple[nn.Module, str]:
    """The module to gather from and the policy's prefix in it, for each way a trainer shards."""
    from torch.distributed.device_mesh import init_device_mesh

    if layout == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,))
        for layer in policy.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(policy, mesh=mesh)
        return policy, ""
    if layout == "dtensor":  # by hand, as tensor parallelism would; the tie kept as one parameter
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh, sharded = init_device_mesh("cpu", (2,)), {}
        for module in list(policy.modules()):
            for name, param in list(module.named_parameters(recurse=False)):
                if id(param) not in sharded:
                    sharded[id(param)] = nn.Parameter(distribute_tensor(param.data, mesh, [Shard(0)]))
                module.register_parameter(name, sharded[id(param)])
        return policy, ""
    if layout == "fsdp1":  # as Lightning's FSDPStrategy: the whole module wrapped, orig params kept
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(
            PolicyAndReference(policy), device_id=torch.device("cpu"), use_orig_params=True
        ), "policy."
    if layout == "ddp":
        return nn.parallel.DistributedDataParallel(PolicyAndReference(policy)), "policy."
    raise ValueError(layout)


def check_layout(rank: int, store: str, layout: str) -> None:
    init_gloo(rank, store)
    try:
        policy, tok = tiny(seed=0)
        unsharded = copy.deepcopy(policy)
        root, prefix = shard(policy, layout)
        if layout != "ddp":
            assert any(isinstance(p, DTensor) or getattr(p, "_fsdp_flattened", False) for p in root.parameters()), (
                "not sharded"
            )
        with torch.no_grad():  # a stand-in for an optimizer step, on the shards and on the full copy
            for model in (policy, unsharded):
                for i, p in enumerate(model.parameters()):
                    p.add_(0.01 * (i + 1))
        expected = unsharded.state_dict()

        named = list(full_named_tensors(root, prefix=prefix))
        assert_same_state(dict(named), expected)  # names, order, values
        if layout == "ddp":  # no copies when nothing is sharded
            assert all(
                t.data_ptr() == expected_p.data_ptr() for (_, t), expected_p in zip(named, policy.state_dict().values())
            )
        if layout == "fsdp1":
            with pytest.raises(ValueError, match="FullyShardedDataParallel wrapper"):
                full_named_tensors(root.module.policy)
        digests = [None, None]
        dist.all_gather_object(digests, [(n, hashlib.sha256(t.numpy().tobytes()).hexdigest()) for n, t in named])
        assert digests[0] == digests[1], "ranks gathered different tensors"

        sampler = HFSampler(tiny(seed=1)[0], tok)
        try:
            sampler.update_weights(full_named_tensors(root, prefix=prefix))
            assert_same_state(sampler.model.state_dict(), expected)
        finally:
            sampler.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", ["fsdp2", "dtensor", "fsdp1", "ddp"])
def test_sharded_policy_gathers_to_the_unsharded_state_on_both_ranks(tmp_path, layout):
    spawn2(check_layout, tmp_path, layout)


# --- Lightning strategies, 2 CPU processes ----------------------------------------------------


def lightning_run(layout: str, out_dir: Path) -> None:
    """Two manual-optimization steps; each rank saves what it gathers after each step."""
    import lightning as L
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
    from torch.utils.data import DataLoader, TensorDataset

    class CPUFSDPStrategy(FSDPStrategy):
        """Lightning refuses `FSDPStrategy` itself on CPU (`type(strategy) is FSDPStrategy`); a subclass passes."""

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.policy = tiny(seed=0)[0]

        def configure_model(self) -> None:
            if layout == "model_parallel":
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for layer in self.policy.model.layers:
                    fully_shard(layer, mesh=mesh)
                fully_shard(self.policy, mesh=mesh)
            else:  # Lightning would pass device_id=None, which FSDP1 rejects on a machine without GPU
                from torch.distributed.fsdp import FullyShardedDataParallel

                self.policy = FullyShardedDataParallel(self.policy, device_id=torch.device("cpu"), use_orig_params=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.policy.parameters(), lr=0.5)

        def training_step(self, batch, batch_idx):
            (tokens,) = batch
            loss = self.policy(tokens).logits.float().logsumexp(-1).mean()
            self.manual_backward(loss)
            self.optimizers().step()
            self.optimizers().zero_grad()
            self.save_gathered("training_step", batch_idx)

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:  # where the weight sync runs
            self.save_gathered("batch_end", batch_idx)

        def save_gathered(self, where: str, step: int) -> None:
            named = [(n, t.clone()) for n, t in full_named_tensors(self.trainer.strategy.model, prefix="policy.")]
            param_types = sorted({type(p).__name__ for p in self.policy.parameters()})
            torch.save(
                {
                    "named": named,
                    "param_types": param_types,
                    "strategy_model": type(self.trainer.strategy.model).__name__,
                },
                out_dir / f"{where}{step}_rank{self.global_rank}.pt",
            )

    strategy = (
        ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=COLLECTIVE_TIMEOUT)
        if layout == "model_parallel"
        else CPUFSDPStrategy(timeout=COLLECTIVE_TIMEOUT)
    )
    tokens = torch.randint(8, 100, (8, 6), generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), DataLoader(TensorDataset(tokens), batch_size=2))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["model_parallel", "fsdp1"])
def test_lightning_strategy_gathers_identical_full_tensors_on_both_ranks(tmp_path, layout):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, __file__, layout, str(tmp_path)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # rank 1 is Lightning's child of this process
        output, _ = proc.communicate()
        pytest.fail(f"the Lightning run did not finish in 180 s:\n{output[-4000:]}")
    assert proc.returncode == 0, output[-4000:]

    init = tiny(seed=0)[0].state_dict()
    for where in ("training_step0", "batch_end0", "training_step1", "batch_end1"):
        ranks = [torch.load(tmp_path / f"{where}_rank{r}.pt", weights_only=False) for r in (0, 1)]
        assert [n for n, _ in ranks[0]["named"]] == list(init), where
        for (name, t0), (_, t1) in zip(ranks[0]["named"], ranks[1]["named"]):
            assert t0.shape == init[name].shape and torch.equal(t0, t1), f"{where}: {name}"
        assert not torch.equal(dict(ranks[0]["named"])["model.norm.weight"], init["model.norm.weight"]), "no step taken"
    if layout == "model_parallel":  # pl_module.policy itself holds DTensors: no wrapper to pass
        assert ranks[0]["param_types"] == ["DTensor"] and ranks[0]["strategy_model"] == "Module"


if __name__ == "__main__":
    lightning_run(sys.argv[1], Path(sys.argv[2]))
