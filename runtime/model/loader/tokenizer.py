"""The tokenizer moved to ``pie_ctx.tokenizer`` (the SDK needs it without torch)."""

from pie_ctx.tokenizer import END_OF_TURN_TOKENS, IncrementalDecoder, Tokenizer

__all__ = ["Tokenizer", "IncrementalDecoder", "END_OF_TURN_TOKENS"]
