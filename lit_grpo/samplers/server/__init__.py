"""The vLLM server wing: `sampler=vllm_server` and the servers it talks to.

sampler.py          VLLMServerSampler: completions and scores over HTTP from server replicas
build.py            its builder: attach to running servers or start them, serving the policy's starting weights
requests.py         routing, bounded concurrency, retries and failover across replicas
answers.py          the requests sent to a server and the reading of its answers (completions, streamed chunks, scores)
partial.py          partial rollouts: streams a weight sync interrupts, continued on the new weights
scoring.py          IGPO's scoring of target tokens over the servers
weight_files.py     weight syncs: through a safetensors file the servers reload, every replica phase by phase
weight_transfer.py  weight syncs through vLLM's weight-transfer API (gloo on CPU, nccl on GPU)
adapters.py         a LoRA policy's adapter-only sync: each version loaded as an adapter the requests name
pool.py             local servers as subprocesses, each in its own process group
serve.py            `python -m lit_grpo.serve`: a vLLM OpenAI server set up for lit_grpo
keys.py             the server key: the middleware that guards every route but /health, the header sent
reaper.py           the watcher that stops a killed server's engine and workers
vllm_plugin/        the vLLM plugin (the `lit_grpo_gloo` weight-transfer backend)
"""
