//! The quickstart's tests: the page's flow against a real PostgreSQL and NATS (`flow`), and the
//! page kept identical to the code it quotes (`page`).

mod flow;
mod page;
