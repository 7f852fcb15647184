"""Training infrastructure shared by pretraining, fine-tuning, the server's worker and engines, and the benchmarks:

- `atomic_io`: files and directories published atomically (standard library only);
- `checkpoint_dirs`: a run's `checkpoint-<step>` directories (listing, newest, rotation) and `CheckpointWriteError`
  (standard library only);
- `checkpointer`: pretraining's `Checkpointer` (background writes of `Stateful` objects), `sharded_checkpoint` its
  backend through `torch.distributed.checkpoint`, `staging` the CPU copies both write from;
- `adapter_merge`: a PEFT LoRA adapter merged into its base model (`merge_adapter`, `write_merged_checkpoint`);
- `callbacks`: the hooks a run reports to (metrics, checkpoints, pause and cancel);
- `balancing`, `distributed`, `sharding`, `runtime`, `allocator`: the training step's own machinery.

Each module is imported by its own name; this package imports nothing, so the server can use its standard-library
modules without loading torch.
"""
