//! `cargo xtask bench [--gpu]`: CPU kernel, attention and model throughput,
//! printed as markdown tables for docs/benchmarks.md.

pub fn run(args: &[String]) -> anyhow::Result<()> {
    if let Some(a) = args.first() {
        anyhow::bail!(
            "unknown bench argument `{a}` (GPU benchmarks are not written yet; \
             the GPU parity tests run with `cargo xtask test --gpu`)"
        );
    }
    println!("## CPU kernels\n");
    for row in crate::bench_kernels::run()? {
        println!("{row}");
    }
    println!("\n## CPU attention\n");
    println!(
        "| case | time ms | attention | baseline | ratio | target |\n|---|---|---|---|---|---|"
    );
    for row in crate::bench_attention::run()? {
        println!("{row}");
    }
    crate::fetch_models::run(&[])?;
    println!("\n## Models (tokens/s, 2 threads for llama.cpp)\n");
    println!("| model | test | te-rs tok/s | llama.cpp tok/s |\n|---|---|---|---|");
    for row in crate::bench_models::run(&["smollm2-135m", "gemma3-270m"])? {
        println!("{row}");
    }
    Ok(())
}
