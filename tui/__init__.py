"""The Textual terminal app (importable as `sekv_local.tui`). Until it lands, `sekv-local chat`
runs a line-based REPL."""
