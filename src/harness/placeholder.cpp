namespace samebits{}
