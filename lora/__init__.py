"""Multi-LoRA serving: adapters held in device slots and applied to a mixed batch in one
pass per projection (segmented shrink/expand, see `lora.ops`)."""
