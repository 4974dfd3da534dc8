"""Policies map the acting agent's view of s_k and a seed to an action."""
