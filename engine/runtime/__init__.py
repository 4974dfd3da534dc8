"""The agent runtime: turns, the recorder, control, and forward runs from any s_k."""
