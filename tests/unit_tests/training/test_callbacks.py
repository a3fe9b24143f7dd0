"""Callbacks: registration by override or by event name, order, shared user state, bad names and bad objects."""

import pytest

from megatron.bridge.training.callbacks import (
    PACKAGE_EVENTS,
    VALID_EVENTS,
    Callback,
    CallbackContext,
    CallbackManager,
    CheckpointCallbackContext,
    fire_checkpoint_event,
    fire_event,
    normalize_callbacks,
    should_fire,
)

MEGATRON_BRIDGE_EVENTS = {
    "on_data_init_start",
    "on_checkpoint_save",
    *(
        f"on_{phase}_{moment}"
        for phase in ("train", "eval", "test")
        for moment in ("start", "step_start", "step_end", "end")
    ),
}


class Recorder(Callback):
    def __init__(self, name, seen):
        self.name, self.seen = name, seen

    def on_train_step_end(self, context):
        self.seen.append((self.name, context.state, context.loss_dict))
        context.user_state[self.name] = context.user_state.get(self.name, 0) + 1


def test_every_megatron_bridge_event_is_valid_and_overridable():
    assert MEGATRON_BRIDGE_EVENTS == VALID_EVENTS
    assert not VALID_EVENTS & PACKAGE_EVENTS  # Megatron-Bridge's set stays exactly its own
    for event in VALID_EVENTS | PACKAGE_EVENTS:
        assert callable(getattr(Callback, event))


def test_only_overridden_events_are_registered_and_run_in_the_order_added():
    seen = []
    manager = CallbackManager()
    manager.add([Recorder("a", seen), Recorder("b", seen)])
    manager.register("on_train_step_end", lambda ctx: seen.append(("fn", ctx.state, None)))
    assert manager.has_callbacks("on_train_step_end")
    assert not manager.has_callbacks("on_train_start")
    assert len(manager.list_callbacks("on_train_step_end")) == 3

    fire_event(manager, "on_train_step_end", "STATE", "model", loss_dict={"lm loss": 1.0})
    fire_event(manager, "on_train_step_end", "STATE", ["model"], loss_dict={"lm loss": 2.0})
    assert seen == [
        ("a", "STATE", {"lm loss": 1.0}),
        ("b", "STATE", {"lm loss": 1.0}),
        ("fn", "STATE", None),
        ("a", "STATE", {"lm loss": 2.0}),
        ("b", "STATE", {"lm loss": 2.0}),
        ("fn", "STATE", None),
    ]
    assert manager.user_state == {"a": 2, "b": 2}  # one dict over every event


def test_unknown_event_and_non_callback_are_refused_with_the_fix():
    manager = CallbackManager()
    with pytest.raises(ValueError, match=r"Unknown event 'on_step_end'.*on_train_step_end"):
        manager.register("on_step_end", print)
    with pytest.raises(ValueError, match="Unknown event"):
        manager.fire("on_validation_end", CallbackContext(state=None, model=[]))
    with pytest.raises(TypeError, match="is not a Callback.*register"):
        manager.add([object()])


def test_pretrain_callbacks_argument_forms():
    assert normalize_callbacks(None) is None
    manager = CallbackManager()
    assert normalize_callbacks(manager) is manager
    made = normalize_callbacks([Recorder("a", [])])
    assert isinstance(made, CallbackManager) and made.has_callbacks("on_train_step_end")
    assert should_fire(made, "on_train_step_end") and not should_fire(made, "on_train_end")
    assert not should_fire(None, "on_train_end")


def test_an_exception_in_a_callback_propagates():
    manager = CallbackManager()

    def boom(ctx):
        raise RuntimeError("callback failed")

    manager.register("on_train_start", boom)
    with pytest.raises(RuntimeError, match="callback failed"):
        fire_event(manager, "on_train_start", None, [])


def test_checkpoint_events_get_the_checkpoint_and_its_tier():
    from megatron.bridge.training.checkpointing import CheckpointType

    seen = []

    class Saver(Callback):
        def on_checkpoint_save(self, context):
            seen.append(("save", context))

        def on_checkpoint_load(self, context):
            seen.append(("load", context))

    manager = CallbackManager()
    manager.add(Saver())
    manager.user_state["k"] = 1
    assert "on_checkpoint_save" in VALID_EVENTS and "on_checkpoint_load" in PACKAGE_EVENTS
    fire_checkpoint_event(manager, "on_checkpoint_save", "STATE", "/ckpt/iter_0000004", CheckpointType.GLOBAL)
    fire_checkpoint_event(manager, "on_checkpoint_load", "STATE", "/local", CheckpointType.LOCAL)
    fire_checkpoint_event(None, "on_checkpoint_save", "STATE", "/ckpt/iter_0000008", CheckpointType.GLOBAL)
    assert [(event, type(c), c.checkpoint_name, c.checkpoint_type) for event, c in seen] == [
        ("save", CheckpointCallbackContext, "/ckpt/iter_0000004", CheckpointType.GLOBAL),
        ("load", CheckpointCallbackContext, "/local", CheckpointType.LOCAL),
    ]
    assert all(c.state == "STATE" and c.user_state == {"k": 1} for _, c in seen)


def test_the_loops_features_run_before_the_users_callbacks_and_share_their_user_state():
    seen = []

    class Feature(Callback):
        def on_train_step_start(self, context):
            seen.append(("feature", context.state))

    user = CallbackManager()
    user.register("on_train_step_start", lambda context: seen.append(("user", context.user_state["x"])))
    user.user_state["x"] = 1
    loop = CallbackManager.chain([Feature()], user)
    fire_event(loop, "on_train_step_start", "STATE", model=[])
    assert seen == [("feature", "STATE"), ("user", 1)]
    assert loop.user_state is user.user_state
    assert user.list_callbacks("on_train_step_start") != loop.list_callbacks("on_train_step_start")  # user's intact
    assert CallbackManager.chain([Feature()], None).has_callbacks("on_train_step_start")
