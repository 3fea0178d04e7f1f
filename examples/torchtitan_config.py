"""gefen-titan's components in torchtitan's own trainer, without recipes.

A torchtitan 0.3.0 config function (``--module`` / ``--config``) that swaps
in the Gefen optimizer container and the checkpoint manager that reshards
its state; everything else is torchtitan's ``llama3_debugmodel``::

    PYTHONPATH=examples torchrun --nproc_per_node=2 -m torchtitan.train \
        --module torchtitan_config --config llama3_debug_gefen --training.steps 10

torchtitan's CLI (tyro) then works as usual on top (``--help``,
``--training.steps``, ``--dump_folder``). The settings marked CPU make the
same function train on CPU ranks with gloo; on GPUs they are harmless
(the attention override does nothing where an accelerator is present).
"""

from torchtitan.models.llama3 import config_registry

from gefen_titan import GefenCheckpointManager, GefenOptimizersContainer, patches
from gefen_titan.data import corpus as data
from gefen_titan.data.elastic import ElasticTextDataLoader

# torchtitan 0.3.0 on torch 2.13 needs these on every device (the PP and
# process-group timeout fixes) and more on CPU: apply them before the trainer
# is built. Importing gefen_titan alone patches nothing.
patches.apply_all()


def llama3_debug_gefen():
    config = config_registry.llama3_debugmodel()
    config.optimizer = GefenOptimizersContainer.Config(name="Gefen", lr=2e-3, weight_decay=0.1)
    config.checkpoint = GefenCheckpointManager.Config(enable=True, folder="checkpoint", interval=10,
                                                      last_save_model_only=False)
    # The embedded corpus and tokenizer (no hub access); resumes at another
    # DP size continue the data stream.
    config.dataloader = ElasticTextDataLoader.Config(dataset=data.DATASET_NAME, on_dp_change="continue")
    config.hf_assets_path = data.DEFAULT_TOKENIZER_PATH
    config.training.seq_len, config.training.local_batch_size = 256, 4
    config.validator.enable = False
    # CPU: FSDP2 under torch 2.13 wants DTensor parameters, fp32 is the
    # portable CPU precision, FlexAttention has no CPU backward.
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.mixed_precision_param = "float32"
    config.override.imports = ["gefen_titan.patches.sdpa_attention.sdpa_attention"]
    return config
