"""Generated-kernel runtime: kernel cache, dispatch, torch ops and the decoder (not built yet)."""
