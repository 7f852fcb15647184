"""Accelerated paths beside the reference model (`zaya_model.modeling_zaya`), applied on request; each has a test
of equality with the reference."""
