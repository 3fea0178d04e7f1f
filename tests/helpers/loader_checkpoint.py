"""A GefenCheckpointManager around a data loader alone (shared by the data
loader resume tests): the model, optimizer and LR scheduler are stand-ins."""

import torch
import torch.nn as nn

from gefen_titan.checkpoint.manager import GefenCheckpointManager


class Blob:
    """Stand-in optimizer / LR scheduler state for the checkpoint manager."""

    def state_dict(self):
        return {"blob": torch.zeros(1)}

    def load_state_dict(self, sd):
        pass


def manager(folder, dataloader):
    cfg = GefenCheckpointManager.Config(
        enable=True, folder=folder, interval=1, keep_latest_k=0, last_save_model_only=False
    )
    torch.manual_seed(0)
    return cfg.build(
        dataloader=dataloader, model_parts=[nn.Linear(2, 2)], optimizers=Blob(),
        lr_schedulers=Blob(), states={}, sd_adapter=None, base_folder="",
    )
