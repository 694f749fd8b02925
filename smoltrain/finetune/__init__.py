"""Fine-tuning a Hugging Face checkpoint: the user's text and chats as token ids with a loss mask
(`data`, `examples`), LoRA adapters with PEFT's semantics and names (`lora`), and what a run
leaves behind: a transformers folder, a PEFT adapter folder or the merged model (`export`), and
an adapter applied as `generate`/`serve` read the base (`adapter`)."""
