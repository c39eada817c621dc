"""The test bed: what canaryd's tests, benchmarks and demo build on, and nothing the product needs.

* `tinymodel`: tiny Llama-style models built on the spot (seeded or briefly trained, byte-level tokenizer),
  since weights cannot be downloaded where canaryd is tested;
* `vllm_process`: a real vLLM OpenAI-compatible server as a subprocess, and the config block that probes it;
* the ``scripted`` backend kind (`canaryd.backends.scripted`, registered like every kind) answers from its
  config, so the probe pass, the canary shapes, the detector and the daemon run without any server.

No product module imports this package; ``canaryd demo`` does (it is a test bed run for a newcomer).
"""
