//! The cluster suite: collectives and faults across MPI ranks (`tributary_actors::cluster`,
//! feature `mpi`), in one test binary:
//!
//! ```sh
//! TRIBUTARY_REQUIRE_MPI=1 cargo test --features mpi --test cluster
//! ```
//!
//! Each test launches `mpirun -np N <this binary> --exact <module>::<name>` on itself
//! (`tributary_testkit::cluster`, [`tributary_testkit::cluster_test!`]); without the `mpi`
//! feature or without `mpirun` it prints `skipping MPI (<test>): <reason>` and passes,
//! unless `TRIBUTARY_REQUIRE_MPI=1`.

mod cluster_collectives;
mod cluster_faults;
mod cluster_steps;
