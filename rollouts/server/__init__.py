"""Our server: the embedded JAX engine served over HTTP with SGLang's native protocol (sglang
0.5.23), so that the SGLang client (rollouts/sglang.py) runs for real in CI, where SGLang
itself cannot, and so that a CPU or TPU run can serve its policy from processes of its own.

Its rooms:
  protocol.py     SGLang's wire protocol: what a /generate body may hold and how it is
                  refused, the requests made of it, its images, the response shape
  scheduler.py    the continuous-batching scheduler: requests decoded one token at a time
                  in batches (rollouts/decoding.py's programs), so that abort, pause and
                  weight updates take effect between tokens; the prefix cache; memory release
  http_server.py  the endpoints over http.server, their keys, `serve` (one in this process)
  adapters.py     LoRA adapters as SGLang serves them (--enable-lora): loads from PEFT
                  directories, requests naming them, unloads waiting for their requests,
                  reloads, eviction
  main.py         the command line (`python -m rollouts.server`), loading a model to serve,
                  `launch` (one as a subprocess)
The engine factory that starts servers as subprocesses for a run is
rollouts.sglang_engine.local_engine, beside remote_engine.

It serves the subset of SGLang's endpoints a trainer uses, with SGLang's request checks and
response shapes (../shared/reference/sglang.md sections 1-2): /generate (single and batch, n,
stream, return_logprob), /abort_request (a live rid, or all; partial output),
/pause_generation (abort, retract, in_place), /continue_generation, /update_weights_from_disk,
/update_weight_version, /flush_cache, /release_memory_occupation, /resume_memory_occupation (a
hybrid deployment's turns: weights and KV cache freed while the trainer runs), /model_info,
/server_info, /health, /health_generate, /ready, /v1/loads, /v1/models, return_routed_experts
(a mixture's, with --enable-return-routed-experts), and with --enable-lora
/load_lora_adapter, /unload_lora_adapter and /generate's lora_path (adapters.py). It behaves as SGLang where a client can go
wrong (docs/sglang.md, section 3): an unknown rid's abort does nothing, a live rid is refused,
the entry at logprob_start_len is null, /health generates (so it blocks while paused or
updating), requests arriving while paused or updating wait outside the scheduler,
sampling_seed counts only with --deterministic, --dtype auto serves float32 in float16,
requests stop at the checkpoint's eos ids, and a release while busy, a resume of what was not
released, or a request or weight load on released memory takes the server down. A quantized
checkpoint (FP8 blocks or compressed-tensors INT4, models/hf.py) is served as SGLang serves
it: its projections held as stored, dequantized at every step (the model's
unpack_projections); a refit of an INT4 one takes the server down, as it takes SGLang's
(rollouts/sglang_engine.py refusals). A /generate call's rids are registered before its
images are read, so an abort meanwhile is lost, as in SGLang (Scheduler.register); a request
whose input + max_new_tokens exceed --context-length (default config.json's) is refused with
SGLang's 400 (protocol.context_error); --api-key and --admin-api-key guard the calls as
SGLang's do (http_server.Server.refuses).

Log-probs follow SGLang: log_softmax(logits / temperature) over the whole vocabulary (raw
log_softmax when greedy).
"""
