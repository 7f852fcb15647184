"""CPU acceleration beside the reference model: compiled decode steps (`zaya_model.cpu.decode`) and compiled block
parts for training and prefill (`zaya_model.cpu.compiled_layers`), applied by whoever asks for them (the local engine,
the trainers' `--compile`, the benchmarks). Each has a test of equality with the reference."""
