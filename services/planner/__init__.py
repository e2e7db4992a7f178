"""`epdserve plan`: how many encoders, prefills and decodes a traffic needs to meet its latency SLOs on this
hardware, predicted from a profile of one engine of the model (profile.py, measured here) through a queueing
model of each role (layout_model.py); plan.py ranks the layouts."""
