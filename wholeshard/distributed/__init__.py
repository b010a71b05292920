"""Process groups: the collectives wholeshard issues (`collectives`, the only module that calls
torch.distributed's collectives), the groups a `DataParallel` makes (`groups`), and the local
launcher of worker processes (`launch`) and the request that stops them at a step boundary
(`stop`)."""
