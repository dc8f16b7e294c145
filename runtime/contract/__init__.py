"""The artifact contract: what titan-build writes and the runtime reads, defined once.

The reader's side lives here, under runtime/, because the runtime must not import the builder;
the builder imports these modules to write. Nothing here imports builder, model or run-path
code, nor torch._dynamo: of titan, only the torch-free floor (runtime/common). This package
imports nothing on its own: each module is imported by name.
"""
