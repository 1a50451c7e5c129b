"""Training: the LightningModule, optimizer/schedule, strategies and the LightningCLI."""
