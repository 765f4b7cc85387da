"""A reward model as a reward (`lit_grpo.rewards.reward_model`): its scores against transformers' own
forward of the same formatted text, batched against one by one, its config and preflight errors,
its place outside the policy's optimizer and checkpoint, its weight in a sum with a rule reward,
and a policy learning (about 15 s) what a hand-set reward model rewards, from the command line."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import compose_config, trained_steps
from transformers import AutoModelForSequenceClassification, AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

from lit_grpo.config import ConfigError, RewardConfig
from lit_grpo.models.load import build_char_tokenizer
from lit_grpo.rewards import RewardScorer, WeightedReward, build_reward, get_reward
from lit_grpo.rewards.reward_model import forward_scores, reward_model_reward

PAIRS = [
    ("2+3=", "5"),
    ("7+1=", "8 and some more text"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}], "2"),
    ([{"role": "user", "content": "9+0="}, {"role": "assistant", "content": "9"}], "nine"),  # the answer is dropped
    ("4+4=", ""),
]


def save_reward_model(folder: Path, *, num_labels: int = 1, chat_template: bool = True, pad: bool = True) -> Path:
    """A tiny random Qwen2 sequence classifier and its character tokenizer, saved to `folder`."""
    tokenizer = build_char_tokenizer("printable")
    if not chat_template:
        tokenizer.chat_template = None
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256, num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id if pad else None, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # scores far apart enough that a wrong pooling shows
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def reference_score(folder: Path, prompt, completion: str) -> float:
    """transformers' own forward of the text the reward model should read (the module docstring's rule)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    messages = [m for m in messages if m["role"] != "assistant"] + [{"role": "assistant", "content": completion}]
    if tokenizer.chat_template:
        ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    else:
        ids = tokenizer("\n".join(m["content"] for m in messages[:-1]) + completion)
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids["input_ids"]])).logits[0, 0])


def scores(reward, pairs) -> list[float]:
    """The reward's scores of (prompt, completion) pairs, all requested at once (so they batch)."""

    async def all_of():
        return await asyncio.gather(
            *(reward(c, {"messages" if isinstance(p, list) else "prompt": p}) for p, c in pairs)
        )

    return list(asyncio.run(all_of()))


@pytest.fixture
def rm_folder(tmp_path):
    return save_reward_model(tmp_path / "rm")


def test_the_chat_template_formats_prompt_and_completion(rm_folder):
    tokenizer = AutoTokenizer.from_pretrained(rm_folder)
    from lit_grpo.rewards.reward_model import input_ids

    assert tokenizer.decode(input_ids(tokenizer, "2+3=", "5")) == "<|user|>2+3=<|end|><|assistant|>5<|end|>"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("chat_template", [True, False])
def test_scores_are_transformers_own_forward_of_the_formatted_text(tmp_path, chat_template):
    folder = save_reward_model(tmp_path / "rm", chat_template=chat_template)
    reward = reward_model_reward(RewardConfig(model=str(folder), model_device="cpu"))
    got = scores(reward, PAIRS)
    want = [reference_score(folder, p, c) for p, c in PAIRS]
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(s, 4) for s in want)) == len(want)  # distinct: a pair scored as another would show
    assert all(not p.requires_grad for p in reward.model.parameters()) and not reward.model.training


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pad", [True, False])
def test_a_batch_scores_as_one_by_one(tmp_path, pad):
    folder = save_reward_model(tmp_path / "rm", pad=pad)
    pairs = [(f"{i}+{i}=", "x" * (i % 5) + str(2 * i)) for i in range(12)]  # lengths differ: padding
    batched = reward_model_reward(RewardConfig(model=str(folder), model_device="cpu", model_batch_size=5))
    alone = reward_model_reward(RewardConfig(model=str(folder), model_device="cpu", model_batch_size=1))
    got, want = scores(batched, pairs), scores(alone, pairs)
    assert got == pytest.approx(want, abs=1e-5)
    assert 3 <= batched.batches < 12 and alone.batches == 12  # 12 requests in batches of at most 5


def test_without_a_pad_token_each_sequence_is_its_own_forward(tmp_path):
    folder = save_reward_model(tmp_path / "rm", pad=False)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    calls = []
    model.register_forward_hook(lambda module, args, kwargs_out: calls.append(1))
    assert forward_scores(model, [[5, 6], [7, 8, 9], [10, 11]])[0] == forward_scores(model, [[5, 6]])[0]
    assert len(calls) == 4


@pytest.mark.timeout(120)
def test_it_composes_with_a_rule_reward_in_the_weighted_sum(rm_folder):
    cfg = RewardConfig(fn=["arithmetic", "reward_model"], weights=[1.0, 0.5], model=str(rm_folder), model_device="cpu")
    reward = build_reward(cfg, lambda: get_reward("arithmetic"), "arithmetic", lambda: reward_model_reward(cfg))
    row = {"prompt": "2+3=", "answer": "5"}
    [right, wrong] = RewardScorer(reward).score_all_blocking([("5", row), ("6", row)])
    rm_right, rm_wrong = reference_score(rm_folder, "2+3=", "5"), reference_score(rm_folder, "2+3=", "6")
    assert right.parts == pytest.approx({"reward/arithmetic": 1.0, "reward/reward_model": rm_right}, abs=1e-5)
    assert right.value == pytest.approx(1.0 + 0.5 * rm_right, abs=1e-5)
    assert wrong.value == pytest.approx(0.5 * rm_wrong, abs=1e-5)


@pytest.mark.timeout(60)
def test_a_slow_forward_meets_the_rewards_deadline_and_the_next_batch_still_scores(rm_folder):
    import time

    reward = reward_model_reward(RewardConfig(model=str(rm_folder), model_device="cpu"))
    fast, calls = reward.forward, []

    def slow_once(ids):
        calls.append(len(ids))
        if len(calls) == 1:
            time.sleep(1.0)
        return fast(ids)

    reward.forward = slow_once
    scorer = RewardScorer(WeightedReward([("reward_model", reward)], [1.0]), timeout_s=0.3, timeout_reward=-7.0)
    row = {"prompt": "2+3="}
    late = scorer.score_all_blocking([("5", row), ("6", row)])
    assert [s.value for s in late] == [-7.0, -7.0] and all(s.timed_out for s in late)
    time.sleep(1.0)  # the late forward ends (one forward at a time), its answers to nobody
    [on_time] = scorer.score_all_blocking([("5", row)])
    assert on_time.value == pytest.approx(reference_score(rm_folder, "2+3=", "5"), abs=1e-5)
    assert not on_time.timed_out and calls == [2, 1]


def test_a_token_id_prompt_is_refused_naming_the_fix(rm_folder):
    from lit_grpo.rewards import RewardRowError

    reward = reward_model_reward(RewardConfig(model=str(rm_folder), model_device="cpu"))
    with pytest.raises(RewardRowError, match="not token ids"):
        asyncio.run(reward("5", {"prompt_token_ids": [1, 2, 3]}))


def test_config_shapes_are_checked_naming_the_field():
    assert RewardConfig(model="org/rm").specs() == ["reward_model"]  # alone when reward.fn is null
    with pytest.raises(ConfigError, match=r"`reward.fn`: names 'reward_model'.*reward.model is null"):
        RewardConfig(fn=["gsm8k", "reward_model"])
    with pytest.raises(ConfigError, match=r"`reward.model`: is set, but .* reward.fn=\[gsm8k,reward_model\]"):
        RewardConfig(fn="gsm8k", model="org/rm")
    with pytest.raises(ConfigError, match="reward.model_dtype"):
        RewardConfig(model="org/rm", model_dtype="int8")
    with pytest.raises(ConfigError, match="reward.model_device"):
        RewardConfig(model="org/rm", model_device="gpu0")
    with pytest.raises(ConfigError, match="reward.model_batch_size"):
        RewardConfig(model="org/rm", model_batch_size=0)


def test_reward_model_knobs_without_effect_are_named():
    from lit_grpo.config import TrainConfig, ineffective_knobs

    assert ineffective_knobs(TrainConfig(reward=RewardConfig(model="org/rm", model_dtype="bfloat16"))) == []
    knobs = ineffective_knobs(TrainConfig(reward=RewardConfig(model_batch_size=4)))
    assert knobs == ["reward.model_batch_size=4 has no effect without reward.model"]
    served = RewardConfig(model="org/rm", model_url="http://h:1", model_device="cuda")
    assert ineffective_knobs(TrainConfig(reward=served)) == [
        "reward.model_device=cuda has no effect with reward.model_url: the server runs the reward model"
    ]


def test_a_model_of_several_labels_or_no_score_head_is_refused(tmp_path):
    folder = save_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(ConfigError, match="num_labels=2"):
        reward_model_reward(RewardConfig(model=str(folder), model_device="cpu"))
    from transformers import Qwen2ForCausalLM

    lm = Qwen2ForCausalLM(Qwen2Config(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2))  # fmt: skip
    lm.save_pretrained(tmp_path / "lm")
    build_char_tokenizer("printable").save_pretrained(tmp_path / "lm")
    with pytest.raises(ConfigError, match=r"no trained score head.*score.weight"):
        reward_model_reward(RewardConfig(model=str(tmp_path / "lm"), model_device="cpu"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", ["/no/such/rm", "nobody-here/no-such-rm"])
def test_an_unreachable_reward_model_is_one_message_before_the_policy_loads(tmp_path, monkeypatch, model):
    import lit_grpo.build
    from lit_grpo.train import train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(lit_grpo.build, "load_policy", lambda *a: pytest.fail("the policy was loaded"))
    with pytest.raises(ConfigError, match="reward.model") as err:
        train(compose_config("+experiment=arithmetic", f"reward.model={model}", output_dir=tmp_path / "run"))
    assert model in str(err.value) and "Traceback" not in str(err.value)


@pytest.mark.timeout(300)
def test_the_reward_model_is_neither_trained_nor_checkpointed(tmp_path, rm_folder):
    from lit_grpo.build import build_run
    from lit_grpo.run.validate import validate

    c = validate(compose_config(
        "+experiment=arithmetic", f"reward.model={rm_folder}", "reward.model_device=cpu", "max_steps=1",
        output_dir=tmp_path / "run",
    ))  # fmt: skip
    trainer, module, datamodule = build_run(c)
    try:
        [rm] = [fn for name, fn in datamodule.reward_scorer.components if name == "reward_model"]
        rm_params = {id(p) for p in rm.model.parameters()}
        optimizers = module.configure_optimizers()
        optimizer = optimizers["optimizer"] if isinstance(optimizers, dict) else optimizers
        optimizer = optimizer[0] if isinstance(optimizer, (list, tuple)) else optimizer
        trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
        assert trained and not trained & rm_params
        saved = module.state_dict()
        assert not {id(t) for t in saved.values()} & rm_params
        assert not any(k.startswith("score.") or ".score." in k for k in saved)
    finally:
        datamodule.close()


# --------------------------------------------------------------------------- learning from a reward model


def save_counting_reward_model(folder: Path, char: str = "7") -> Path:
    """A Qwen2 classifier whose weights are set by hand so that its score grows with the share of
    `char` among the tokens it reads: every embedding holds a constant 1 on dimension 1 and `char`'s
    also a 1 on dimension 0; one layer whose zero queries and keys attend uniformly, carrying
    dimension 0 (the share of `char`) into the last position; no MLP; the head reads dimension 0
    (the final norm keeps it monotone, as dimension 1 stays 1)."""
    tokenizer = build_char_tokenizer("printable")
    d = 8
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=d, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, max_position_embeddings=256, num_labels=1, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        emb = model.model.embed_tokens.weight
        emb[:, 1] = 1.0
        emb[tokenizer.convert_tokens_to_ids(char), 0] = 1.0
        layer = model.model.layers[0]
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
        layer.self_attn.v_proj.weight[0, 0] = 1.0
        layer.self_attn.o_proj.weight[0, 0] = 1.0
        model.model.norm.weight.fill_(1.0)
        model.score.weight[0, 0] = 1.0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_the_hand_set_reward_model_counts_its_token(tmp_path):
    reward = reward_model_reward(
        RewardConfig(model=str(save_counting_reward_model(tmp_path / "rm")), model_device="cpu")
    )
    got = scores(reward, [("2+3=", c) for c in ("5", "7", "77", "777", "7777")])
    assert got[0] == pytest.approx(0.0, abs=1e-6) and got == sorted(got) and len(set(got)) == 5


@pytest.mark.timeout(600)
def test_a_policy_learns_what_the_reward_model_rewards_from_the_command_line(tmp_path):
    folder = save_counting_reward_model(tmp_path / "rm")
    run = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run(
        [
            sys.executable, "-m", "lit_grpo.train", "+experiment=arithmetic", f"reward.model={folder}",
            "reward.model_device=cpu", "sampler.max_completion_tokens=4", "max_steps=40", "learning_rate=1e-2",
            "trainer.enable_progress_bar=false", "~callbacks.reward_filter", "checkpoint.save_interval=20",
            f"hydra.run.dir={run}",
        ],
        check=True, env=env, cwd=tmp_path, timeout=540,
    )  # fmt: skip
    steps = trained_steps(run, "reward/mean")
    first = sum(s["reward/mean"] for s in steps[:5]) / 5
    last = sum(s["reward/mean"] for s in steps[-5:]) / 5
    print(f"reward/mean: first 5 steps {first:.3f}, last 5 steps {last:.3f} ({len(steps)} steps)")
    assert last > first + 0.6, (first, last)  # measured: 0.43 -> 1.53 (the most, all 7s: about 1.9)

    # The checkpoint holds the policy (hidden size 64) and its optimizer, nothing of the reward model (8).
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(run / "checkpoints" / "step_00000040")).read_metadata().state_dict_metadata
    assert not any("score" in k for k in keys)
    embeddings = [k for k in keys if k.endswith("embed_tokens.weight")]
    assert embeddings and all(keys[k].size[-1] == 64 for k in embeddings)


# --------------------------------------------------------------------------- served (reward.model_url)


class FakeClassifyServer:
    """A `/classify` endpoint on a free loopback port that scores token ids with `score(ids)` the
    way vLLM's pooling runner answers (raw logits with use_activation false), needs `key` when set,
    and answers `status` instead when that is set; it records each request's body and headers."""

    def __init__(self, score, key=None) -> None:
        import http.server
        import json
        import threading

        self.requests, self.status = [], None
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, body, dict(self.headers)))
                if key and self.headers.get("Authorization") != f"Bearer {key}":
                    return self._answer(401, {"error": "Unauthorized"})
                if outer.status:
                    return self._answer(outer.status, {"error": "down"})
                data = [{"index": i, "probs": [score(ids)], "num_classes": 1} for i, ids in enumerate(body["input"])]
                self._answer(200, {"data": data[::-1]})  # any order: the index says which

            def _answer(self, code, payload):
                raw = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.timeout(120)
def test_a_served_reward_model_scores_the_same_token_ids_with_its_key(rm_folder, monkeypatch):
    from lit_grpo.rewards.reward_server import RewardServerError

    model = AutoModelForSequenceClassification.from_pretrained(rm_folder).eval()
    server = FakeClassifyServer(lambda ids: forward_scores(model, [ids])[0], key="s3cret")
    try:
        monkeypatch.setenv("MY_RM_KEY", "s3cret")
        cfg = RewardConfig(model=str(rm_folder), model_url=server.url, model_api_key_env="MY_RM_KEY")
        served = reward_model_reward(cfg)
        assert served.model is None  # only the tokenizer loaded here
        got = scores(served, PAIRS)
        assert got == pytest.approx([reference_score(rm_folder, p, c) for p, c in PAIRS], abs=1e-5)
        path, body, headers = server.requests[0]
        assert path == "/classify" and body["use_activation"] is False and len(server.requests) < len(PAIRS)
        assert isinstance(body["input"][0][0], int)  # token ids: formatted here, by the reward model's tokenizer

        monkeypatch.setenv("MY_RM_KEY", "wrong")
        with pytest.raises(RewardServerError, match="answered 401.*MY_RM_KEY"):
            scores(served, PAIRS[:1])
        monkeypatch.setenv("MY_RM_KEY", "s3cret")
        server.status = 503
        with pytest.raises(ConnectionError, match="answered 503"):  # transient: the rollout retries it
            scores(served, PAIRS[:1])
    finally:
        server.close()
    with pytest.raises(ConnectionError, match=r"reward model server .* \(reward.model_url\)"):
        scores(served, PAIRS[:1])  # nobody listens any more


def test_a_served_reward_model_config_is_checked():
    with pytest.raises(ConfigError, match="`reward.model_url`: needs reward.model"):
        RewardConfig(model_url="http://127.0.0.1:8001")
    with pytest.raises(ConfigError, match="`reward.model_url`: must be http"):
        RewardConfig(model="org/rm", model_url="127.0.0.1:8001")
    with pytest.raises(ConfigError, match="reward.model_api_key_env"):
        RewardConfig(model="org/rm", model_url="http://h:1", model_api_key_env="not a name")


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_vllm_serves_the_reward_model_with_the_same_scores(tmp_path, monkeypatch):
    """vLLM 0.32's CPU build, pooling runner (`--runner pooling --convert classify`), behind lit_grpo's key."""
    pytest.importorskip("vllm")
    from lit_grpo.samplers.server.pool import start_servers

    tokenizer = build_char_tokenizer("printable")
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256, num_labels=1, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip  # vLLM's CPU attention needs a head size >= 32
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
    folder = tmp_path / "rm"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    pool = start_servers(
        folder, 1, log_dir=tmp_path / "logs", dtype="float32", max_model_len=256, kv_cache_memory_bytes="64M",
        extra_args=["--runner", "pooling", "--convert", "classify", "--gpu-memory-utilization", "0.3"],
        api_key="rm-key", ready_timeout_s=400,
    )  # fmt: skip
    try:
        monkeypatch.setenv("LIT_GRPO_SERVER_KEY", "rm-key")
        served = reward_model_reward(RewardConfig(model=str(folder), model_url=pool.urls[0]))
        here = reward_model_reward(RewardConfig(model=str(folder), model_device="cpu"))
        assert scores(served, PAIRS) == pytest.approx(scores(here, PAIRS), abs=1e-4)
    finally:
        pool.stop()


def test_the_reward_model_name_is_taken():
    from lit_grpo.rewards import register_reward

    with pytest.raises(ValueError, match="reward model's component"):
        register_reward("reward_model")(lambda text, row: 0.0)
    with pytest.raises(ConfigError, match=r"unknown reward 'reward_modle'.*reward_model \(the reward model"):
        get_reward("reward_modle")


@pytest.mark.timeout(300)
def test_a_reward_server_that_dies_stops_the_run_naming_it_and_resume_continues(tmp_path, rm_folder):
    from lit_grpo.errors import EnvironmentFault
    from lit_grpo.train import train

    model = AutoModelForSequenceClassification.from_pretrained(rm_folder).eval()
    server = FakeClassifyServer(lambda ids: forward_scores(model, [ids])[0])
    run = [
        "+experiment=arithmetic", f"reward.model={rm_folder}", "checkpoint.save_interval=1",
        "~callbacks.reward_filter", "guards.rollout_max_retries=0", "trainer.enable_progress_bar=false",
    ]  # fmt: skip
    try:
        train(compose_config(*run, f"reward.model_url={server.url}", "max_steps=2", output_dir=tmp_path))
        server.status = 503  # the server dies: every call fails from now on
        with pytest.raises(EnvironmentFault) as stopped:
            train(compose_config(*run, f"reward.model_url={server.url}", "max_steps=4", "resume=auto",
                                 output_dir=tmp_path))  # fmt: skip
        message = str(stopped.value)
        print(message)
        assert f"reward model server {server.url} (reward.model_url)" in message, message
        assert "rollout_fn" not in message and "fix the rollout function" not in message
        assert "training stopped after step 2" in message
        assert "Start the reward model server again" in message and "continues from step 2" in message
        server.status = None  # started again: the run continues from its checkpoint
        summary = train(compose_config(*run, f"reward.model_url={server.url}", "max_steps=4", "resume=auto",
                                       output_dir=tmp_path))  # fmt: skip
        assert summary["steps"] == 4
    finally:
        server.close()
