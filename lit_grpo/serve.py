"""`python -m lit_grpo.serve --model DIR --port P`: a vLLM OpenAI server set up for lit_grpo
(`lit_grpo/samplers/server/serve.py` holds it; `--help` lists the options)."""

from lit_grpo.samplers.server.serve import main

if __name__ == "__main__":
    main()
