//! Writes the seed corpora: `cargo run --manifest-path fuzz/Cargo.toml
//! --features seeds --bin make_seeds -- fuzz/corpus`. Each target's
//! directory is emptied first, so a seed that is no longer made goes away.

use std::path::PathBuf;

fn main() {
    let root = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "fuzz/corpus".into()),
    );
    let seeds = ferry_fuzz::seeds::all();
    let mut dirs: Vec<&str> = seeds
        .iter()
        .filter_map(|(n, _)| n.split('/').next())
        .collect();
    dirs.dedup();
    for d in dirs {
        let dir = root.join(d);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create a corpus directory");
    }
    let mut total = 0;
    for (name, bytes) in &seeds {
        std::fs::write(root.join(name), bytes).expect("write a seed");
        total += bytes.len();
    }
    println!(
        "{} seeds, {} bytes, in {}",
        seeds.len(),
        total,
        root.display()
    );
}
