"""The heist scenario ("the mole game"): a seeded world, the tools agents use to learn it, the
crew config, the mole, and the rule that decides whether the crew's plan would work."""
