"""Text: token ids from strings and back, and what a chat turn renders to.

`tokenizer.Tokenizer` (Hugging Face `tokenizers`, the ids transformers gives), `gguf_vocab`
(a tokenizer built from a GGUF file's vocabulary), `chunks` (where a long text may be cut
without changing its ids), `chat_template` (OpenAI `messages` to a prompt, as transformers
renders it) and `resolve` (which tokenizer an engine uses: `EngineConfig(tokenizer=)`).

May import: `hf` (GGUF headers), the specs (`resolve` only) and the base.
"""
