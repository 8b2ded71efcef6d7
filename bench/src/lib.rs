//! What `glm5-bench` shares with CPU tests: the serving load generator.

pub mod serve_load;
