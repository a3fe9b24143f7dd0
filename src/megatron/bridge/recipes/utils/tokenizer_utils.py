"""The recipes' tokenizer default (Megatron-Bridge's ``recipes.utils.tokenizer_utils``)."""

DEFAULT_NULL_TOKENIZER_VOCAB_SIZE: int = 32000
"""The ``NullTokenizer`` vocabulary of the pretraining recipes: mock token ids are drawn below it, and it is below
every recipe model's vocabulary, so they always fit the embedding."""

__all__ = ["DEFAULT_NULL_TOKENIZER_VOCAB_SIZE"]
