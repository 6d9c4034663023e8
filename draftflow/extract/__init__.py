"""Stage 5, hidden-state extraction: one wing, one owner per concern.

- ``layout``: the only module that knows the stage's file names, records and
  journal format (no torch: the progress check and the plan import it);
- ``hidden_states``: writes and checks the ``hs_<i>.safetensors`` files;
- ``shards``: plans shards and server jobs, runs a server job's shards with
  journals, heartbeats and manifests;
- ``backends``, ``transformers_backend``, ``vllm_backend``, ``vllm_connector``:
  the two ways to compute hidden states (the CPU connector runs inside vLLM);
- ``fidelity``: whether the two backends agree.
"""
