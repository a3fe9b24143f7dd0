"""Helpers recipes are built from (Megatron-Bridge's ``recipes.utils``): optimizer presets, data paths, defaults."""
