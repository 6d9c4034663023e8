"""The demo's own inputs, built by the workflow's ``demo_target`` rule: a tiny target and
its prompts, made from the running Python's standard library. Not part of the
``draftflow`` package (nor of its wheel): a user's run never imports it."""
