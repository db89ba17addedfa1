"""Multi-LoRA serving: PEFT adapter loading and validation, and the device slots that hold the
adapters a step uses."""
