"""Pretrain any recipe by name; the rest of the command line is dotted ``key=value`` overrides.

    torchrun --nproc-per-node=2 examples/pretrain_recipe.py llama3_tiny_pretrain_config \
        "dataset.blend=[['/data/corpus_text_document'],None]" checkpoint.save=/ckpt checkpoint.load=/ckpt

A file (not ``-m``) so nemo_run's ``run.Script(path=..., entrypoint="python")`` and its plugins can launch it::

    task = run.Script(path="examples/pretrain_recipe.py", entrypoint="python",
                      args=["llama3_tiny_pretrain_config", "train.train_iters=100"])
    run.run(task, executor=run.LocalExecutor(ntasks_per_node=2), plugins=[FaultTolerancePlugin()])

The same as ``python -m megatron.bridge.recipes.run ...`` (which an installed wheel has).
"""

from megatron.bridge.recipes.run import main

if __name__ == "__main__":  # the guard matters: checkpoint writers and data loaders spawn helper processes
    main()
