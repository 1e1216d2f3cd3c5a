//! Placeholder until its issue lands: prints the version so packaging and `make` targets work.
fn main() {
    println!("cli-mcp-server {} (not implemented yet)", env!("CARGO_PKG_VERSION"));
}
