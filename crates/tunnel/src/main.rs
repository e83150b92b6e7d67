mod cli;
mod config;
mod exit;
mod known_hosts;

fn main() {}
