"""The RL pipeline: `python -m rl.train` (one GRPO step as stage functions, the run loop), `rl.session` (run setup),
`rl.check` (trainer/engine agreement), `rl.eval` (pass@k through an engine or an OpenAI-compatible server), and
their pieces (algorithm, batch, data, rewards, warm-up, checkpointing, metrics, config). The trainer's model is the
`rl.model` package."""
