//! Package index client, PEP 440/508 and wheel tags, PubGrub solver, and the lockfile.
