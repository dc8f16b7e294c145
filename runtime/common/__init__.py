"""The torch-free floor every command stands on: Ctrl-C and kill handling (interrupt), progress
lines (progress), last-time estimates (timings), reading untrusted files (safe_files) and the
host's facts (environment). Imports nothing else of titan, and no torch."""
