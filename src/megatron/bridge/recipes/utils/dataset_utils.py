"""Dataset fields of a recipe from lists of data paths (Megatron-Bridge's ``recipes.utils.dataset_utils``).

Only the pretraining part: the fine-tuning dataset presets (SQuAD, Tulu 3, ...) build datasets this package does
not provide.
"""

from typing import Optional

from megatron.bridge.data.loaders import get_blend_and_blend_per_split

Blend = Optional[tuple[list[str], Optional[list[float]]]]
BlendPerSplit = Optional[list[Blend]]


def get_blend_fields_from_data_paths(
    data_paths: Optional[list[str]] = None,
    data_args_path: Optional[str] = None,
    train_data_path: Optional[list[str]] = None,
    valid_data_path: Optional[list[str]] = None,
    test_data_path: Optional[list[str]] = None,
    per_split_data_args_path: Optional[str] = None,
    mock: bool = False,
) -> tuple[Blend, BlendPerSplit, Optional[str]]:
    """``(blend, blend_per_split, split)`` for a ``GPTDatasetConfig`` from data paths; mock data when none is given.

    Each list of paths is either prefixes (``["a", "b"]``) or weights and prefixes interleaved (``["30", "a", "70",
    "b"]``); ``data_args_path`` names a file holding such a list, ``per_split_data_args_path`` a JSON file with a
    list per ``train``/``valid``/``test``. One blend for all splits gets ``split="9999,8,2"``, one blend per split
    ``split=None``; mock data (``mock=True``, or no path given) gets ``(None, None, "1,1,1")``.
    """
    paths = (data_paths, data_args_path, train_data_path, valid_data_path, test_data_path, per_split_data_args_path)
    if mock or not any(paths):
        return None, None, "1,1,1"
    blend, blend_per_split = get_blend_and_blend_per_split(
        data_paths=data_paths,
        data_args_path=data_args_path,
        per_split_data_args_path=per_split_data_args_path,
        train_data_paths=train_data_path,
        valid_data_paths=valid_data_path,
        test_data_paths=test_data_path,
    )
    if blend_per_split is not None:
        return None, blend_per_split, None
    if blend is not None:
        return blend, None, "9999,8,2"
    return None, None, "1,1,1"


__all__ = ["get_blend_fields_from_data_paths"]
