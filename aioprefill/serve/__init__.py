"""`aioprefill.serve`: an OpenAI-compatible HTTP server over one `Engine`
(`python -m aioprefill.serve --model PATH`; see docs/serving.md).

| module | what it holds |
| --- | --- |
| `__main__.py` | the command line: flags to an EngineConfig, the tokenizer, the HTTP front |
| `flags.py` | every flag of the command line, grouped as `--help` shows them (`parse_args`) |
| `app.py` | the ASGI app: lifespan, routing, body limits, disconnects, request ids, statuses |
| `routes.py` | `Service`: each endpoint's work on the engine and the tokenizer |
| `auth.py` | API keys: the Bearer check, SIGHUP reload, per-key cache salts |
| `completions.py` | /v1/completions: the checks, the engine options, the OpenAI answer |
| `chat.py` | /v1/chat/completions: the checks, the chat template, the OpenAI answer |
| `render.py` | /v1/completions/render and /v1/chat/completions/render (vLLM's shapes) |
| `prompts.py` | a request's prompt(s) as checked token-id prompts |
| `scoring.py` | how a model scores a query-document pair: template + labels, classifier, cosine |
| `rerank.py` | /v1/rerank and /rerank (Jina/Cohere's and TEI's bodies) |
| `score.py` | /v1/score and /score (vLLM's pairs, SGLang's label_token_ids) |
| `embed.py` | /v1/embeddings and TEI's /embed: pooling, dimensions, truncation, base64 |
| `rank_schemas.py` | the scoring endpoints' bodies as msgspec Structs |
| `schemas.py` | request and response bodies as msgspec Structs |
| `errors.py` | aioprefill's errors as HTTP statuses and OpenAI error objects |
| `fronts.py` | running the app under uvicorn or granian (ASGI or RSGI) |
| `rsgi.py` | the app under granian's RSGI interface |
| `vllm_pd.py` | `--kv-transfer vllm-mooncake`: a stock vLLM decode node's MooncakeConnector peer |
| `vllm_bootstrap.py` | that connector's bootstrap HTTP server (`GET /query`) |
"""
