"""GRPO integrations: TRL trainer wiring, the embedded generator, the main job."""
